"""Memory an optimizer will still allocate for its state: it comes out of the budget of the first steps.

Adam-style optimizers create their state (``exp_avg``, ``exp_avg_sq``) in the first
``optimizer.step()``, after the forward+backward we plan.  A budget given as a share of free
memory must leave room for it, or the first step overruns it.  State that already exists
(a resumed run, a later re-plan) is part of allocated memory and not counted again.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

# Tensors of parameter size each optimizer keeps per parameter.  Optimizers not listed
# are estimated at 2 (as much as Adam), the most common optimizer state.
UNKNOWN_OPTIMIZER_STATES = 2


def states_per_param(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """How many parameter-sized state tensors ``optimizer`` keeps for each parameter of ``group``."""
    name = type(optimizer).__name__
    if name in ("Adam", "AdamW"):
        return 3 if group.get("amsgrad") else 2
    if name in ("NAdam", "RAdam", "Adamax", "Adadelta", "Rprop"):
        return 2
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    if name in ("Adagrad", "ASGD"):
        return 1
    return UNKNOWN_OPTIMIZER_STATES


def unwrap(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Lightning's or Accelerate's wrappers."""
    while hasattr(optimizer, "optimizer") and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def pending_state_bytes(optimizers: Iterable) -> int:
    """Bytes of optimizer state not yet allocated for trainable parameters."""
    total = 0
    for wrapped in optimizers:
        opt = unwrap(wrapped)
        for group in opt.param_groups:
            n = states_per_param(opt, group)
            for p in group["params"]:
                if p.requires_grad and not opt.state.get(p):
                    total += n * p.numel() * p.element_size()
    return total
