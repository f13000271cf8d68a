"""remat_plugin: make PyTorch training fit a memory budget by planned rematerialization."""
from remat_plugin.errors import (
    BudgetFormatError,
    CallsInFlightError,
    CaptureError,
    InfeasibleBudgetError,
    OptionError,
    RematError,
)
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.module import RematModule, rematerialize


def __getattr__(name: str):
    if name == "AutoRemat":  # imported on use: lightning is an optional dependency
        from remat_plugin.integrations.lightning import AutoRemat

        return AutoRemat
    if name == "rematerialize_fsdp":  # imported on use, with torch.distributed.fsdp
        from remat_plugin.runtime.fsdp_units import rematerialize_fsdp

        return rematerialize_fsdp
    raise AttributeError(f"module 'remat_plugin' has no attribute {name!r}")


__all__ = [
    "AutoRemat",
    "BudgetFormatError",
    "CallsInFlightError",
    "CaptureError",
    "InfeasibleBudgetError",
    "OptionError",
    "Plan",
    "RematError",
    "RematModule",
    "rematerialize",
    "rematerialize_fsdp",
]
