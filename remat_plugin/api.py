"""Public entry point: ``rematerialize(module, args, kwargs, budget)`` → a module that fits the budget."""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .budget import parse_budget
from .compile import CompiledStep, build_step, input_signature
from .errors import CaptureError
from .execute import partition
from .fallback import checkpointed_layers, fallback_plan, find_layer_chain
from .joint import JointGraph
from .plan import Plan, make_plan
from .profile import profile_ops
from .side_effects import unobserved

log = logging.getLogger(__name__)


def _device_of(args: tuple, kwargs: dict, module: nn.Module) -> torch.device:
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return x.device
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def measured_problem(joint: JointGraph, device: torch.device):
    """The planning problem of ``joint`` with costs measured on ``device``, and its forward constants."""
    costs = profile_ops(joint, device)
    problem = joint.to_problem(costs.time_ms, costs.temp_bytes)
    return problem, {n for n in joint.constants if joint.is_fwd.get(n)}


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
        self.plan: Plan | None = None
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
            with unobserved(self.original, _device_of(args, kwargs, self.original)):
                step(args, kwargs)  # the first call traces and plans; its outputs are dropped
        return info["plan"]

    def _fallback_step(self, err: CaptureError, budget_bytes: int, info: dict[str, Any]):
        """Per-layer checkpointing of the model's repeated layers, when the model has no graph."""
        chain = find_layer_chain(self.original)
        if chain is None:
            raise CaptureError(f"{err} (and no list of repeated layers to fall back on)") from err
        name, layers = chain
        info["plan"] = fallback_plan(str(err), name, layers, budget_bytes, info["signature"])

        def step(args: tuple, kwargs: dict):
            with checkpointed_layers(layers):
                return self.original(*args, **kwargs)

        return step

    def _entry(self, args: tuple, kwargs: dict) -> tuple[CompiledStep, dict[str, Any]]:
        sig = input_signature(self.original, args, kwargs)
        if sig not in self._steps:
            device = _device_of(args, kwargs, self.original)
            budget_bytes = parse_budget(self.budget, device)
            info: dict[str, Any] = {"signature": repr(sig)[:200]}

            def plan_and_partition(joint: JointGraph):
                t0 = time.perf_counter()
                problem, constants = measured_problem(joint, device)
                plan, schedule = make_plan(problem, constants, budget_bytes, self.ilp_time_limit_s)
                plan = dataclasses.replace(plan, planning_s=time.perf_counter() - t0, signature=info["signature"])
                info["plan"], info["problem"] = plan, problem
                self.plan = plan
                return partition(joint, schedule)

            try:
                step = build_step(self.original, args, kwargs, plan_and_partition, device)
            except CaptureError as err:
                step = self._fallback_step(err, budget_bytes, info)
            self._steps[sig] = (step, info)
        step, info = self._steps[sig]
        if "plan" in info:
            self.plan = info["plan"]
        return step, info


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


def capture_problem(module: nn.Module, args: tuple = (), kwargs: dict | None = None):
    """Capture and profile ``module`` on these inputs; return ``(problem, constants)`` without planning.

    For solver studies and benchmarks: the problem is what :func:`rematerialize` plans on.
    Runs one forward of the unmodified schedule (RNG and buffers restored afterwards).
    """
    from .problem import Schedule

    kwargs = dict(kwargs or {})
    device = _device_of(args, kwargs, module)
    found: dict[str, Any] = {}

    def record(joint: JointGraph):
        found["problem"], found["constants"] = measured_problem(joint, device)
        return partition(joint, Schedule.keep_all(found["problem"]))

    step = build_step(module, tuple(args), kwargs, record, device)
    with unobserved(module, device):
        step(tuple(args), kwargs)
    return found["problem"], found["constants"]
