"""remat_plugin: make PyTorch training fit a memory budget by planned rematerialization."""
from remat_plugin.errors import BudgetFormatError, CaptureError, InfeasibleBudgetError, OptionError, RematError
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.module import RematModule, rematerialize


def __getattr__(name: str):
    if name == "AutoRemat":  # imported on use: lightning is an optional dependency
        from remat_plugin.integrations.lightning import AutoRemat

        return AutoRemat
    raise AttributeError(f"module 'remat_plugin' has no attribute {name!r}")


__all__ = [
    "AutoRemat",
    "BudgetFormatError",
    "CaptureError",
    "InfeasibleBudgetError",
    "OptionError",
    "Plan",
    "RematError",
    "RematModule",
    "rematerialize",
]
