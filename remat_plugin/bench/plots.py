"""PNG plots of a ``compare`` run (``bench/compare.py``): the memory–time frontier and step timelines.

matplotlib is needed only here, so it is imported when a plot is drawn, with the Agg backend
(files only; benchmarks run on machines without a display).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["plot_frontier", "plot_timelines"]

MIB = 2**20
# One look per strategy, kept across models so a legend reads the same on every panel.
STYLE = {
    "none": {"color": "black", "marker": "*", "markersize": 12},
    "per_layer": {"color": "tab:blue", "marker": "s", "markersize": 8},
    "sqrt_n": {"color": "tab:green", "marker": "^", "markersize": 9},
    "drop_cheap": {"color": "tab:purple", "marker": "D", "markersize": 7},
    "compile": {"color": "tab:orange", "marker": "o", "markersize": 6},
    "ours": {"color": "tab:red", "marker": "o", "markersize": 6},
    "ours+inductor": {"color": "darkred", "marker": "D", "markersize": 6},
}
NAMES = {
    "none": "none (unmodified)",
    "per_layer": "per-layer checkpoint",
    "sqrt_n": "Chen sqrt(n) segments",
    "drop_cheap": "Chen drop cheap ops",
    "compile": "torch.compile activation_memory_budget",
    "ours": "ours (remat_plugin)",
    "ours+inductor": "ours, compile=True (inductor kernels)",
}
TIMELINE_STYLE = {
    "none measured": {"color": "tab:blue", "linestyle": "-"},
    "keep-all predicted": {"color": "tab:blue", "linestyle": "--"},
    "ours measured": {"color": "tab:red", "linestyle": "-"},
    "ours predicted": {"color": "tab:red", "linestyle": "--"},
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("bench.plots: plots need matplotlib; install it with `pip install matplotlib`.") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(plt: Any, n: int, width: float, height: float) -> tuple[Any, list[Any]]:
    cols = min(2, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def plot_frontier(points: list[dict[str, Any]], path: str | Path, device: str) -> None:
    """Per model: measured peak (MiB) against step time over none, one series per strategy.

    Points with gradients that differ from ``none`` are drawn hollow: they are on the plot because
    they were measured, not because they are usable.
    """
    plt = _pyplot()
    models = list(dict.fromkeys(p["model"] for p in points))
    fig, axes = _grid(plt, len(models), 6.4, 4.6)
    for ax, model in zip(axes, models):
        mine = [p for p in points if p["model"] == model and p["measured_peak_bytes"] is not None]
        mine = [p for p in mine if p["time_ratio"] is not None]
        for strategy, style in STYLE.items():
            series = sorted((p for p in mine if p["strategy"] == strategy), key=lambda p: p["measured_peak_bytes"])
            if not series:
                continue
            x = [p["measured_peak_bytes"] / MIB for p in series]
            y = [p["time_ratio"] for p in series]
            if len(series) > 1:
                ax.plot(x, y, color=style["color"], linewidth=1.2, alpha=0.7)
            for p, xi, yi in zip(series, x, y):
                face = style["color"] if p["grads_equal"] else "none"
                ax.plot(xi, yi, linestyle="none", marker=style["marker"], markersize=style["markersize"],
                        markerfacecolor=face, markeredgecolor=style["color"])  # fmt: skip
                if strategy == "compile":
                    ax.annotate(f"{p['setting']:g}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                                fontsize=7, color=style["color"])  # fmt: skip
            ax.plot([], [], color=style["color"], marker=style["marker"], linestyle="-" if len(series) > 1 else "none",
                    label=NAMES[strategy])  # fmt: skip
        ax.axhline(1.0, color="grey", linewidth=0.6, linestyle=":")
        ax.set_xlabel("measured peak memory of one step (MiB)")
        ax.set_ylabel("step time / none's (median of pairs)")
        ax.set_title(f"{model} on {device}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle("Memory–time frontier: lower left is better; hollow markers: gradients differ from none;\n"
                 "orange labels: torch.compile activation_memory_budget", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timelines(timelines: dict[str, dict[str, Any]], path: str | Path, device: str) -> None:
    """Per model: memory above step start over one step, none and ours, measured and predicted."""
    plt = _pyplot()
    models = [m for m, t in timelines.items() if t.get("series")]
    fig, axes = _grid(plt, max(1, len(models)), 6.4, 4.2)
    for ax, model in zip(axes, models):
        timeline = timelines[model]
        for name, series in timeline["series"].items():
            style = TIMELINE_STYLE.get(name, {})
            ax.plot(series["x"], [b / MIB for b in series["bytes"]], label=name, linewidth=1.1, **style)
            if name.endswith("measured"):
                ax.axvline(series["fwd_end_x"], color=style.get("color", "grey"), linewidth=0.7, linestyle=":")
        if "budget_bytes" in timeline:
            ax.axhline(timeline["budget_bytes"] / MIB, color="tab:red", linewidth=0.7, linestyle="-.",
                       label="ours: budget")  # fmt: skip
            title = f"{model} on {device}: none vs {timeline['ours_label']}"
        else:
            title = f"{model} on {device}: none (no feasible plan of ours to show)"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("share of the step's time (forward, then backward; dotted: end of forward)")
        ax.set_ylabel("memory above step start (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("One training step: measured (CPU storage meter, after each op) and predicted (simulator)",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
