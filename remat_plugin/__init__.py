"""remat_plugin: make PyTorch training fit a memory budget by planned rematerialization."""
from .api import RematModule, rematerialize
from .errors import BudgetFormatError, CaptureError, InfeasibleBudgetError, RematError
from .plan import Plan

__all__ = [
    "BudgetFormatError",
    "CaptureError",
    "InfeasibleBudgetError",
    "Plan",
    "RematError",
    "RematModule",
    "rematerialize",
]
