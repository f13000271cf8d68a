"""Errors a user can cause; each says which stage, the numbers, and the fix."""
from __future__ import annotations


def human_bytes(n: float) -> str:
    """``1536`` → ``'1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class RematError(RuntimeError):
    """Base class of remat_plugin's user-facing errors."""


class BudgetFormatError(RematError, ValueError):
    """A budget string or number that cannot be read."""


class InfeasibleBudgetError(RematError):
    """No schedule fits the budget; carries the smallest budget that would work."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, what: str = "forward+backward"):
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        super().__init__(
            f"remat_plugin.plan: no schedule of the {what} fits the budget of {budget_bytes} bytes "
            f"({human_bytes(budget_bytes)}); the smallest feasible budget is {min_feasible_bytes} bytes "
            f"({human_bytes(min_feasible_bytes)}). Raise the budget to at least that, or reduce the batch size."
        )


class CaptureError(RematError):
    """torch.export could not capture the module; names the failing op or line."""
