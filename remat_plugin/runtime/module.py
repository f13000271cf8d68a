"""Public entry point: ``rematerialize(module, args, kwargs, budget)`` → a module that fits the budget."""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from remat_plugin.capture.export import build_step, input_signature
from remat_plugin.capture.joint import JointGraph
from remat_plugin.capture.programs import partition
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.side_effects import unobserved
from remat_plugin.runtime.steps import Step, device_of, measured_problem, plan_step

log = logging.getLogger(__name__)


class RematModule(nn.Module):
    """Runs ``original`` under a plan per input signature; eval and no-grad calls run ``original`` itself.

    ``original`` is not registered as a child: parameters, buffers and ``state_dict``
    keys are exactly the original's, and the Parameter objects are the same objects.
    """

    original: nn.Module  # set with object.__setattr__: not a registered child

    def __init__(self, original: nn.Module, budget: int | str, ilp_time_limit_s: float = 0.5):
        super().__init__()
        object.__setattr__(self, "original", original)
        self.budget = budget
        self.ilp_time_limit_s = ilp_time_limit_s
        self._steps: dict[tuple, tuple[Any, dict[str, Any]]] = {}
        self._current: dict[str, Any] = {}  # the info of the latest signature run or prepared
        self.training = original.training

    # --- the original's state, unchanged -------------------------------------------------
    def state_dict(self, *args, **kwargs):
        return self.original.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.original.load_state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self.original.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.original.named_buffers(*args, **kwargs)

    def named_children(self):
        return self.original.named_children()

    def named_modules(self, *args, **kwargs):
        return self.original.named_modules(*args, **kwargs)

    def train(self, mode: bool = True):
        self.original.train(mode)
        self.training = mode
        return self

    def _apply(self, fn, recurse=True):
        self.original._apply(fn, recurse)
        self._steps.clear()  # plans are per device and dtype
        return self

    # --- planning and running ------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if not (self.original.training and torch.is_grad_enabled()):
            return self.original(*args, **kwargs)  # nothing is saved for backward: nothing to plan
        return self._entry(args, kwargs)[0](args, kwargs)

    def prepare(self, args: tuple, kwargs: dict) -> Plan:
        """Plan for these inputs now (capture, profile, solve) without changing any state."""
        step, info = self._entry(args, kwargs)
        if "plan" not in info:
            with unobserved(self.original, device_of(args, kwargs, self.original)):
                step(args, kwargs)  # the first call traces and plans; its outputs are dropped
        return info["plan"]

    def _entry(self, args: tuple, kwargs: dict) -> tuple[Step, dict[str, Any]]:
        sig = input_signature(self.original, args, kwargs)
        if sig not in self._steps:
            budget_bytes = parse_budget(self.budget, device_of(args, kwargs, self.original))
            self._steps[sig] = plan_step(self.original, args, kwargs, budget_bytes,
                                         ilp_time_limit_s=self.ilp_time_limit_s, signature=repr(sig)[:200])
        step, info = self._steps[sig]
        self._current = info
        return step, info

    @property
    def plan(self) -> Plan | None:
        """The plan of the latest input signature run or prepared (None before the first)."""
        return self._current.get("plan")


def rematerialize(
    module: nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    budget: int | str = "80%",
    *,
    ilp_time_limit_s: float = 0.5,
) -> RematModule:
    """Plan ``module`` for these example inputs under ``budget`` and return the rewritten module.

    ``budget`` is bytes, a size (``"300MiB"``) or a share of free device memory (``"80%"``):
    the most allocated memory may rise during one forward+backward above what is
    allocated at step start.  Raises :class:`~remat_plugin.errors.InfeasibleBudgetError`
    with the smallest feasible budget when nothing fits.
    """
    rm = RematModule(module, budget, ilp_time_limit_s)
    rm.prepare(tuple(args), dict(kwargs or {}))
    return rm


def capture_problem(module: nn.Module, args: tuple = (), kwargs: dict | None = None, progress=None):
    """Capture and profile ``module`` on these inputs; return ``(problem, constants)`` without planning.

    For solver studies and benchmarks: the problem is what :func:`rematerialize` plans on.
    Runs one forward of the unmodified schedule (RNG and buffers restored afterwards).
    """
    from remat_plugin.ir.problem import Schedule

    kwargs = dict(kwargs or {})
    device = device_of(args, kwargs, module)
    found: dict[str, Any] = {}

    def record(joint: JointGraph):
        if progress is not None:
            progress.stage(f"profile {len(joint.ops)} ops" if device.type != "meta" else "estimate op costs")
        found["problem"], found["constants"] = measured_problem(joint, device, progress)
        return partition(joint, Schedule.keep_all(found["problem"]))

    if progress is not None:
        progress.stage("capture")
    step = build_step(module, tuple(args), kwargs, record, device)
    with unobserved(module, device):
        step(tuple(args), kwargs)
    return found["problem"], found["constants"]
