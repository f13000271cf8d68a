"""Build the planned step of one input signature: plan it afresh, or replay a plan made for larger shapes.

A plan's schedule names joint-graph ops, and the graph of a model is the same for every
shape that traces the same code (a shorter sequence, a smaller batch).  So a plan made for
larger inputs can be replayed on smaller ones without profiling or solving: the new graph
must have the same ops (its ``graph_key``), and the simulator, with the new sizes, must
still put the schedule under the budget.  Otherwise :class:`PlanMismatch` says why and
the caller plans afresh.
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from remat_plugin.capture.estimated_costs import estimate_costs
from remat_plugin.capture.export import CompiledStep, build_step
from remat_plugin.capture.joint import JointGraph
from remat_plugin.capture.measured_costs import profile_ops
from remat_plugin.capture.programs import partition
from remat_plugin.errors import CaptureError, human_bytes
from remat_plugin.ir.plan import Plan, make_plan, safety_margin
from remat_plugin.ir.problem import Schedule
from remat_plugin.ir.simulate import InvalidScheduleError, simulate
from remat_plugin.runtime.fallback import checkpointed_layers, fallback_plan, find_layer_chain

Step = Callable[[tuple, dict], Any]


class PlanMismatch(Exception):
    """A stored plan does not apply to this graph (other ops, or over budget at these sizes)."""


def device_of(args: tuple, kwargs: dict, module: nn.Module) -> torch.device:
    """The device the step runs on: that of the first tensor input, else of the parameters."""
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return x.device
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def graph_key(joint: JointGraph) -> str:
    """What a schedule depends on: the joint graph's ops and their targets, not their sizes."""
    desc = "|".join(f"{n.name}:{n.target}" for n in joint.ops)
    return hashlib.sha1(f"{joint.num_fwd_outputs}|{desc}".encode()).hexdigest()[:16]


def measured_problem(joint: JointGraph, device: torch.device, progress=None):
    """The planning problem of ``joint`` with costs measured on ``device`` (estimated on ``meta``),
    and its forward constants."""
    costs = estimate_costs(joint, progress=progress) if device.type == "meta" else profile_ops(joint, device, progress)
    problem = joint.to_problem(costs.time_ms, costs.temp_bytes)
    return problem, {n for n in joint.constants if joint.is_fwd.get(n)}


def plan_step(module: nn.Module, args: tuple, kwargs: dict, budget_bytes: int, *, ilp_time_limit_s: float,
              signature: str, progress=None, find_floor: bool = True) -> tuple[Step, dict[str, Any]]:
    """A step that captures, profiles and plans on its first call; ``info["plan"]`` is set then.

    Models ``torch.export`` cannot capture fall back to per-layer checkpointing when they have
    a list of repeated layers (``info["plan"].fallback`` says so), else :class:`CaptureError`.
    """
    device = device_of(args, kwargs, module)
    info: dict[str, Any] = {"signature": signature}

    def plan_and_partition(joint: JointGraph):
        t0 = time.perf_counter()
        if progress is not None:
            progress.stage(f"profile {len(joint.ops)} ops")
        problem, constants = measured_problem(joint, device, progress)
        if progress is not None:
            progress.stage("solve blocks, chain DP")
        plan, schedule = make_plan(problem, constants, budget_bytes, ilp_time_limit_s, progress, find_floor)
        plan = dataclasses.replace(plan, planning_s=time.perf_counter() - t0, signature=signature,
                                   graph_key=graph_key(joint))
        info["plan"], info["problem"] = plan, problem
        return partition(joint, schedule)

    if progress is not None:
        progress.stage("capture")
    try:
        return build_step(module, args, kwargs, plan_and_partition, device), info
    except CaptureError as err:
        return _fallback_step(module, err, budget_bytes, info), info


def _fallback_step(module: nn.Module, err: CaptureError, budget_bytes: int, info: dict[str, Any]) -> Step:
    """Per-layer checkpointing of the model's repeated layers, when the model has no graph."""
    chain = find_layer_chain(module)
    if chain is None:
        raise CaptureError(f"{err} (and no list of repeated layers to fall back on)") from err
    name, layers = chain
    info["plan"] = fallback_plan(str(err), name, layers, budget_bytes, info["signature"])

    def step(args: tuple, kwargs: dict):
        with checkpointed_layers(layers):
            return module(*args, **kwargs)

    return step


def replay_step(module: nn.Module, args: tuple, kwargs: dict, plan: Plan, budget_bytes: int,
                signature: str) -> tuple[CompiledStep, dict[str, Any]]:
    """A step running ``plan``'s schedule on these inputs; its first call raises :class:`PlanMismatch`
    (before running anything) if the graph differs or the schedule would exceed ``budget_bytes``."""
    device = device_of(args, kwargs, module)
    info: dict[str, Any] = {"signature": signature}
    if plan.fallback or not plan.graph_key:
        raise PlanMismatch("the plan has no schedule to replay")

    def check_and_partition(joint: JointGraph):
        key = graph_key(joint)
        if key != plan.graph_key:
            raise PlanMismatch(f"graph {key} is not the plan's graph {plan.graph_key}")
        problem = joint.to_problem({}, {})  # sizes decide the fit; times are the plan's
        try:
            sim = simulate(problem, Schedule(plan.schedule))
        except InvalidScheduleError as exc:
            raise PlanMismatch(f"the schedule does not run on this graph: {exc}") from exc
        usable = budget_bytes - safety_margin(budget_bytes)
        if sim.peak_bytes > usable:
            raise PlanMismatch(f"predicted peak {human_bytes(sim.peak_bytes)} exceeds {human_bytes(usable)}")
        info["plan"] = dataclasses.replace(plan, predicted_peak_bytes=sim.peak_bytes, planning_s=0.0,
                                           signature=signature)
        return partition(joint, Schedule(plan.schedule))

    return build_step(module, args, kwargs, check_and_partition, device), info
