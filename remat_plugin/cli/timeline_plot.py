"""The memory timeline of one planned step, against the unmodified step and the budget (matplotlib PNG)."""
from __future__ import annotations

from remat_plugin.ir.plan import Plan

MIB = 2**20


def plot_timeline(plan: Plan, path: str) -> None:
    """Draw ``plan``'s predicted memory per op (forward, then backward with recomputation) to ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("remat report needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    base = [b / MIB for b in plan.baseline_timeline_bytes]
    ours = [b / MIB for b in plan.timeline_bytes]
    ax.plot(range(len(base)), base, label=f"unmodified (peak {max(base):.1f} MiB)", color="tab:gray")
    ax.plot(range(len(ours)), ours, label=f"planned (peak {max(ours):.1f} MiB)", color="tab:blue")
    ax.axhline(plan.budget_bytes / MIB, color="tab:red", linestyle="--",
               label=f"budget {plan.budget_bytes / MIB:.1f} MiB")
    if plan.n_fwd_ops:
        ax.axvline(plan.n_fwd_ops, color="black", linewidth=0.8, linestyle=":", label="forward | backward")
    ax.set_xlabel("op index (forward ops, then backward ops and recomputations)")
    ax.set_ylabel("allocated memory above step start (MiB)")
    ax.set_title(f"remat plan: {plan.signature or 'step'} — predicted overhead {plan.predicted_overhead:.2f}x")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
