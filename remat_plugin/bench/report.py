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


# --- compare (bench/compare.py) ----------------------------------------------------------------

COMPARE_COLUMNS = (
    "model", "strategy", "setting", "measured peak", "dispatch meter", "predicted peak",
    "time ratio", "grads vs none", "plan / compile s", "within budget",
)  # fmt: skip
NO_SLOWER_THAN_COMPILE = 0.05  # the slowdown allowed against activation_memory_budget at equal measured peak


def _mib(nbytes: int | None) -> str:
    return "" if nbytes is None else f"{nbytes / 2**20:.1f} MiB"


def _setting(point: dict[str, Any]) -> str:
    if point["strategy"] == "compile":
        return f"activation_memory_budget={point['setting']:g}"
    if point["strategy"] not in ("ours", "ours+inductor"):
        return ""
    text = f"budget {_mib(point['budget_bytes'])} ({point['setting']:.2f})"
    return text + (f" = {', '.join(point['matched_to'])} peak" if point["matched_to"] else "")


def _grads(point: dict[str, Any]) -> str:
    if point["grads_exact"] is None:
        return ""
    if point["grads_exact"]:
        return "exact"
    diff = point["grad_max_abs_diff"]
    return f"{'allclose' if point['grads_equal'] else 'NO'} (max diff {diff:.2g})"


def _compare_cells(point: dict[str, Any]) -> list[str]:
    none_peak = point["none_peak_bytes"]
    if point["infeasible"]:
        measured = f"infeasible (min {_mib(point['min_feasible_bytes'])})"
    elif point["error"]:
        measured = f"error: {point['error'].splitlines()[0][:80]}"
    else:
        measured = f"{_mib(point['measured_peak_bytes'])} ({point['measured_peak_bytes'] / none_peak:.2f})"
    dispatch = _mib(point["dispatch_peak_bytes"])
    if point["strategy"] == "compile" and point["meter"] == "profiler":
        dispatch = "cannot see compiled code"
    ratio = "" if point["time_ratio"] is None else f"{point['time_ratio']:.2f}"
    if point["predicted_time_ratio"] is not None and ratio:
        ratio += f" (pred {point['predicted_time_ratio']:.2f})"
    plan_s = "" if point["plan_s"] is None else f"{point['plan_s']:.1f}"
    return [
        point["model"], point["label"], _setting(point), measured, dispatch, _mib(point["predicted_peak_bytes"]),
        ratio, _grads(point), plan_s, _yes_no(point["within_budget"]),
    ]  # fmt: skip


def _measured_point(point: dict[str, Any]) -> bool:
    return point["measured_peak_bytes"] is not None and point["time_ratio"] is not None


def frontier_comparison(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For every peer point: our point planned at that peer's measured peak, if it measured at or below it.

    Only when there is no such point (``--no-match``) is it the fastest of our points at that peak
    or lower: picking the fastest of several noisy points would flatter us. Our points with
    gradients unequal to none's never count. The verdict against a checkpointing peer is "faster"
    or "slower"; against torch.compile's activation_memory_budget, "slower" only beyond
    NO_SLOWER_THAN_COMPILE (the bar against it at equal measured peak).
    """
    found = []
    for model in dict.fromkeys(p["model"] for p in points):
        mine = [p for p in points if p["model"] == model and _measured_point(p)]
        for peer, ours in _peer_pairs(mine):
            reaching = [p for p in ours if p["measured_peak_bytes"] <= peer["measured_peak_bytes"]]
            matched = [p for p in reaching if peer["label"] in (p.get("matched_to") or ())]
            best = min(matched or reaching, key=lambda p: p["time_ratio"], default=None)
            entry = {
                "model": model, "peer": peer["label"], "peer_peak_bytes": peer["measured_peak_bytes"],
                "peer_time_ratio": peer["time_ratio"], "peer_grads_equal": peer["grads_equal"],
                "none_peak_bytes": peer["none_peak_bytes"], "ours": None, "ours_peak_bytes": None,
                "ours_time_ratio": None, "time_change": None, "verdict": "ours cannot reach this peak",
            }  # fmt: skip
            if best is not None:
                change = best["time_ratio"] / peer["time_ratio"] - 1
                tolerance = NO_SLOWER_THAN_COMPILE if peer["strategy"] == "compile" else 0.0
                verdict = "ours faster" if change < 0 else ("ours within 5%" if change <= tolerance else "ours slower")
                entry.update(
                    ours=best["label"], ours_peak_bytes=best["measured_peak_bytes"],
                    ours_time_ratio=best["time_ratio"], time_change=change, verdict=verdict,
                )  # fmt: skip
            found.append(entry)
    return found


def _peer_pairs(points: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each peer point with the points of ours it is compared with: ours (eager programs) against every peer,
    and ours+inductor (compiled programs), where measured, against torch.compile's points too.  Ours with
    gradients unequal to none's never count."""
    mine = {s: [p for p in points if p["strategy"] == s and p["grads_equal"]] for s in ("ours", "ours+inductor")}
    pairs = []
    for peer in (p for p in points if p["strategy"] not in ("none", "ours", "ours+inductor")):
        pairs.append((peer, mine["ours"]))
        if peer["strategy"] == "compile" and mine["ours+inductor"]:
            pairs.append((peer, mine["ours+inductor"]))
    return pairs


def format_frontier_comparison(comparisons: list[dict[str, Any]]) -> str:
    """Markdown table: each peer point against our fastest point at its measured peak or lower."""
    columns = ("model", "peer", "peer peak", "peer time", "ours (planned at the peer's peak)", "ours peak", "ours time",
               "ours vs peer")  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for c in comparisons:
        none_peak = c["none_peak_bytes"]
        peer_time = f"{c['peer_time_ratio']:.2f}" + ("" if c["peer_grads_equal"] else " (grads differ)")
        peer_peak = f"{_mib(c['peer_peak_bytes'])} ({c['peer_peak_bytes'] / none_peak:.2f})"
        if c["ours"] is None:
            ours = ["", "", "", c["verdict"]]
        else:
            verdict = f"{c['verdict']}: time {c['time_change']:+.0%}"
            ours_peak = f"{_mib(c['ours_peak_bytes'])} ({c['ours_peak_bytes'] / none_peak:.2f})"
            ours = [c["ours"], ours_peak, f"{c['ours_time_ratio']:.2f}", verdict]
        lines.append("| " + " | ".join([c["model"], c["peer"], peer_peak, peer_time, *ours]) + " |")
    return "\n".join(lines)


def format_compare(payload: dict[str, Any]) -> str:
    """The compare command's Markdown: settings, every point, then each peer against our frontier."""
    settings = payload["settings"]
    lines = [
        f"# remat_plugin compare: {settings['device']}, {settings['dtype']}",
        "",
        (
            f"{payload['date']}; {payload['machine']}; torch {payload['torch_version']}, {settings['threads']} threads;"
            f" {settings['pairs']} timed pairs per point; torch.compile backend {settings['backend']};"
            f" run took {payload['wall_s']:.0f} s."
        ),
        "",
        f"Meter: {payload['meter_note']}",
        "Time ratio: median over interleaved (none, strategy) step pairs of strategy time / none time.",
        "Grads vs none: exact (bitwise), allclose (float32: rtol 1e-5, atol 1e-6), or NO, with the largest absolute difference.",
        "",
        "## Every point",
        "",
        "| " + " | ".join(COMPARE_COLUMNS) + " |",
        "|" + "|".join("---" for _ in COMPARE_COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(_compare_cells(p)) + " |" for p in payload["points"]]
    lines += ["", "## Against each peer at equal measured peak", "", format_frontier_comparison(payload["comparisons"])]
    return "\n".join(lines) + "\n"
