"""Budget sweeps shared by the tests that check plans against a meter."""
from __future__ import annotations

from remat_plugin.ir.plan import Plan, budget_for_peak


def sweep(plan: Plan, n: int = 10) -> list[int]:
    """``n`` budgets from the unmodified peak (with its margin) down to the plan's smallest feasible budget."""
    base, floor = budget_for_peak(plan.baseline_peak_bytes), plan.min_feasible_bytes
    return [int(base - (base - floor) * i / (n - 1)) for i in range(n)]
