"""Formatting of benchmark rows (``bench/run.py``): a Markdown table, the peer comparison, JSON."""

from __future__ import annotations

import json
from typing import Any

import torch

from remat_plugin.errors import human_bytes

__all__ = ["BENCH_SCHEMA_VERSION", "compare_with_peers", "format_comparisons", "format_table", "to_json"]

BENCH_SCHEMA_VERSION = 1
COLUMNS = (
    "model", "strategy", "budget", "measured peak", "predicted peak",
    "time ratio", "plan s", "grads equal", "within budget",
)  # fmt: skip
COMPARED_PEERS = ("per_layer", "sqrt_n")


def _share(nbytes: int, row: dict[str, Any]) -> str:
    return f"{human_bytes(nbytes)} ({nbytes / row['none_peak_bytes']:.2f})"


def _yes_no(value: bool | None) -> str:
    return "" if value is None else ("yes" if value else "NO")


def _cells(row: dict[str, Any]) -> list[str]:
    budget = "" if row["budget_bytes"] is None else f"{human_bytes(row['budget_bytes'])} ({row['budget_fraction']:g})"
    if row.get("infeasible"):
        measured = f"infeasible (min feasible {_share(row['min_feasible_bytes'], row)})"
    elif row.get("error"):
        measured = f"error: {row['error'].splitlines()[0][:80]}"
    else:
        measured = _share(row["measured_peak_bytes"], row)
    predicted = "" if row["predicted_peak_bytes"] is None else _share(row["predicted_peak_bytes"], row)
    ratio = "" if row["time_ratio"] is None else f"{row['time_ratio']:.2f}"
    if row["predicted_time_ratio"] is not None:
        ratio += f" (pred {row['predicted_time_ratio']:.2f})"
    # Wall time of rematerialize (capture, profile, solve): what a user waits for. The plan's own
    # planning_s (JSON "plan_s") leaves out capture and work cached from an earlier plan.
    plan_s = "" if row.get("plan_wall_s") is None else f"{row['plan_wall_s']:.1f}"
    return [
        row["model"], row["strategy"], budget, measured, predicted,
        ratio, plan_s, _yes_no(row["grads_equal"]), _yes_no(row["within_budget"]),
    ]  # fmt: skip


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table, one line per row; peaks as bytes and as a share of the model's ``none`` peak."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    return "\n".join(lines)


def compare_with_peers(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each GPT-2 model and checkpointing peer: the fastest of our measured plans at that peak or lower.

    That is the project's claim: at the memory a standard checkpointing recipe reaches, the plan
    pays less time (or, at the same time, reaches less memory).
    """
    found = []
    for model in dict.fromkeys(row["model"] for row in rows):
        if not model.startswith("gpt2"):
            continue
        ours = [r for r in rows if r["model"] == model and r["strategy"].startswith("ours@") and _measured(r)]
        for peer in COMPARED_PEERS:
            peer_row = next((r for r in rows if r["model"] == model and r["strategy"] == peer and _measured(r)), None)
            if peer_row is None:
                continue
            reaching = [r for r in ours if r["measured_peak_bytes"] <= peer_row["measured_peak_bytes"]]
            best = min(reaching, key=lambda r: r["time_ratio"], default=None)
            found.append({
                "model": model,
                "peer": peer,
                "peer_peak_bytes": peer_row["measured_peak_bytes"],
                "peer_time_ratio": peer_row["time_ratio"],
                "ours": None if best is None else best["strategy"],
                "ours_peak_bytes": None if best is None else best["measured_peak_bytes"],
                "ours_time_ratio": None if best is None else best["time_ratio"],
                "none_peak_bytes": peer_row["none_peak_bytes"],
            })  # fmt: skip
    return found


def _measured(row: dict[str, Any]) -> bool:
    return row.get("measured_peak_bytes") is not None and row.get("time_ratio") is not None


def format_comparisons(comparisons: list[dict[str, Any]]) -> str:
    """One line per (model, peer): where the peer lands and which of our budgets matches it."""
    lines = []
    for c in comparisons:
        none_peak = c["none_peak_bytes"]
        peer = (
            f"{c['model']}: {c['peer']} peaks at {human_bytes(c['peer_peak_bytes'])}"
            f" ({c['peer_peak_bytes'] / none_peak:.2f} of none) at time ratio {c['peer_time_ratio']:.2f}"
        )
        if c["ours"] is None:
            lines.append(f"{peer}; none of our budgets reached that peak.")
        else:
            lines.append(
                f"{peer}; {c['ours']} peaks at {human_bytes(c['ours_peak_bytes'])}"
                f" ({c['ours_peak_bytes'] / none_peak:.2f}) at time ratio {c['ours_time_ratio']:.2f}."
            )
    return "\n".join(lines)


def to_json(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    """Everything the run measured, with the settings and versions that produced it."""
    payload = {
        "schema_version": BENCH_SCHEMA_VERSION,
        "settings": settings,
        "torch_version": torch.__version__,
        "rows": rows,
        "comparisons": compare_with_peers(rows),
    }
    return json.dumps(payload, indent=1)
