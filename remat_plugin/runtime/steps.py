"""Build the planned step of one call: plan it afresh, or replay a plan made for larger shapes.

A plan's schedule names joint-graph ops, and the graph of a model is the same for every
shape that traces the same code (a shorter sequence, a smaller batch).  So a plan made for
larger inputs can be replayed on smaller ones without profiling or solving: the new graph
must have the same ops (its ``graph_key``), and the simulator, with the new sizes, must
still put the schedule under the budget.  Otherwise :class:`PlanMismatch` says why and
the caller plans afresh.

AOTAutograd traces the joint graph at a step's first call, and planning happens inside that
trace; so a :class:`PlannedStep` knows its plan and problem once it has been called.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat_plugin.capture.estimated_costs import estimate_costs
from remat_plugin.capture.export import EAGER, ExecutionOptions, build_step
from remat_plugin.capture.forward_effects import MUTATED_INPUTS_META
from remat_plugin.capture.joint import JointGraph
from remat_plugin.capture.measured_costs import OpTimings, profile_ops, scratch_of
from remat_plugin.capture.output_usage import OutputUsage
from remat_plugin.capture.programs import emit_programs
from remat_plugin.capture.repeated_layers import find_layer_chains
from remat_plugin.errors import CaptureError, human_bytes
from remat_plugin.ir.plan import Plan, safety_margin
from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import InvalidScheduleError, simulate
from remat_plugin.planning.choose_plan import PlannerCache, make_plan
from remat_plugin.runtime.fallback import CheckpointedRun, fallback_plan
from remat_plugin.runtime.side_effects import unobserved
from remat_plugin.runtime.signature import Call
from remat_plugin.torch_private import pytree, suspended_user_modes


class PlanMismatch(Exception):
    """A stored plan does not apply to this graph (other ops, or over budget at these sizes)."""


@dataclass
class PlanningCaches:
    """What planning keeps between plans of one model: measured op times and prepared planners.

    Owned by the runtime object that plans (a :class:`~remat_plugin.runtime.module.RematModule`,
    a session, a batch-size search) and passed down; nothing is kept in module state.
    """

    op_timings: OpTimings = field(default_factory=OpTimings)
    planners: PlannerCache = field(default_factory=PlannerCache)


# The default owner for runtimes not given their own: plans of the same shapes made again in this
# process (another budget, a new RematModule, a resumed run) measure the same costs, hence get the
# same problem and reuse its prepared planner.  Both caches are bounded.
PROCESS_CACHES = PlanningCaches()


@dataclass(eq=False)
class PlannedStep:
    """The step of one input signature: call it with the user's args and kwargs.

    ``plan`` is the plan it runs (for a replayed plan, with its predicted peak at these sizes
    once the first call has checked it); ``problem`` is the planning problem it was solved on
    (None for a replayed plan, whose graph carries no measured times, and for a fallback).
    ``checked`` is True once the plan is made or checked for this graph (the first call).
    ``tensor_ids`` are the identities of the module's parameters and buffers it was built with
    (:func:`~remat_plugin.runtime.signature.module_state`): it runs those tensors.
    """

    run: Callable[[tuple, dict], Any]
    signature_key: str
    plan: Plan | None = None
    problem: Problem | None = None
    checked: bool = False
    tensor_ids: tuple[int, ...] = ()
    to_meter: bool = False  # to be metered before its next call runs (NOTE [calibration])

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        return self.run(args, kwargs)

    @contextlib.contextmanager
    def planning_only(self) -> Iterator[None]:
        """Inside, calls are made only to plan (outputs dropped, state restored): the forward need not be
        computed (NOTE [planning runs] in :mod:`remat_plugin.capture.export`)."""
        run = self.run
        if not hasattr(run, "planning_only"):
            yield
            return
        was = run.planning_only  # nested (a planning run inside prepare's): the outer one still holds on exit
        run.planning_only = True  # type: ignore[attr-defined]
        try:
            yield
        finally:
            run.planning_only = was  # type: ignore[attr-defined]

    def exported_module(self) -> torch.fx.GraphModule | None:
        """The exported module its graph was traced from (None for a fallback), for a new plan of the same call."""
        return getattr(self.run, "exported", None)

    def compiled_programs(self) -> list[Callable]:
        """The forward and backward programs its first call built (inductor segments under ``compile=True``)."""
        return list(getattr(self.run, "programs", ()))

    def changed_values(self) -> list[tuple[str, Any, Any]]:
        """The modules' Python values changed since its graph was traced (NOTE [module attributes]): each
        ``(where, now, traced with)``; none for a fallback, which runs the forward's Python."""
        guard = getattr(self.run, "guard", None)
        return guard.changed() if guard is not None else []

    def take_usage(self) -> OutputUsage | None:
        """What the caller did with the outputs of the latest call whose backward began (once; None if unseen)."""
        usage = getattr(self.run, "usage", None)
        if usage is not None:
            self.run.usage = None  # type: ignore[attr-defined]
        return usage


def measured_problem(joint: JointGraph, device: torch.device, progress=None,
                     op_timings: OpTimings | None = None) -> tuple[Problem, set[str]]:
    """The planning problem of ``joint`` with costs measured on ``device`` (estimated on ``meta``),
    and the forward ops the planner treats as constants."""
    if device.type == "meta":
        costs = estimate_costs(joint, progress=progress)
    else:
        costs = profile_ops(joint, device, progress, op_timings, joint.real_inputs)
    problem = joint.to_problem(costs.time_ms, costs.temp_bytes)
    return problem, joint.constant_ops()


def _scratch_ops(joint: JointGraph, problem: Problem) -> tuple[tuple[str, int], ...]:
    """The ops planned with kernel scratch, with its bytes (their temporary bytes beyond the outputs nothing reads)."""
    return tuple((op.name, op.temp_bytes - joint.unread_output_bytes.get(op.name, 0)) for op in problem.ops
                 if op.temp_bytes > joint.unread_output_bytes.get(op.name, 0))


def plan_step(module: nn.Module, call: Call, budget_bytes: int, *, ilp_time_limit_s: float,
              caches: PlanningCaches, progress=None, find_floor: bool = True,
              on_plan: Callable[[PlannedStep], None] | None = None,
              dropped_outputs: frozenset[int] = frozenset(), ungraded_outputs: frozenset[int] = frozenset(),
              calibration_bytes: int = 0,
              options: ExecutionOptions = EAGER, exported: torch.fx.GraphModule | None = None,
              on_fallback_in_call: Callable[[PlannedStep], None] | None = None) -> PlannedStep:
    """A step that captures, profiles and plans on its first call; ``on_plan(step)`` runs once its plan is made.

    ``dropped_outputs``: flat tensor outputs the caller drops before backward, freed once returned
    (NOTE [dropped outputs] in :mod:`remat_plugin.capture.joint`); ``ungraded_outputs``: those the caller
    holds that no gradient reaches (NOTE [dropped tangents]).  ``calibration_bytes``: kept back from
    the budget for what a metered step showed the model misses (NOTE [calibration]).  ``options``: where the
    caller runs ``backward()`` and whether the programs are compiled (:class:`ExecutionOptions`).
    ``exported``: the exported module of an earlier step of this very call (:meth:`PlannedStep.exported_module`),
    traced again instead of exporting the model anew.  ``on_fallback_in_call(step)``: told of a fallback made
    inside a call (the exported graph failed at the trace), before that call runs it (NOTE [metered fallback]).

    Models ``torch.export`` cannot capture fall back to per-layer checkpointing when they have
    a list of repeated layers (``step.plan.fallback`` says so, and ``on_plan`` runs at once),
    else :class:`CaptureError`.
    """
    step = PlannedStep(run=_not_built, signature_key=call.key, tensor_ids=call.tensor_ids)

    def plan_and_emit(joint: JointGraph):
        t0 = time.perf_counter()
        if progress is not None:
            progress.stage(f"profile {len(joint.ops)} ops")
        problem, constants = measured_problem(joint, call.device, progress, caches.op_timings)
        if progress is not None:
            progress.stage("solve blocks, chain DP")
        t_solve = time.perf_counter()
        plan, schedule = make_plan(problem, constants, budget_bytes, ilp_time_limit_s, progress, find_floor,
                                   caches.planners, calibration_bytes)
        trace_started = getattr(step.run, "trace_started", None) or t0
        stages = (("export", export_s), ("trace", t0 - trace_started), ("profile", t_solve - t0),
                  *plan.planning_stages)
        step.plan = dataclasses.replace(plan, planning_s=time.perf_counter() - t0, signature=call.key,
                                        graph_key=joint.structure_key, dropped_outputs=tuple(sorted(dropped_outputs)),
                                        ungraded_outputs=tuple(sorted(ungraded_outputs)),
                                        planning_stages=stages, scratch_ops=_scratch_ops(joint, problem))
        step.problem, step.checked = problem, True
        if on_plan is not None:
            on_plan(step)
        return emit_programs(joint, schedule)

    if progress is not None:
        progress.stage("capture")
    export_started = time.perf_counter()
    try:
        step.run = build_step(module, call.args, call.kwargs, plan_and_emit, call.device, dropped_outputs, options,
                              ungraded_outputs, exported)
        export_s = time.perf_counter() - export_started

        def untraceable(err: CaptureError) -> Callable[[tuple, dict], Any]:  # NOTE [untraceable graphs]
            step.run = _fallback(module, err, budget_bytes, step)
            step.checked = True
            if on_plan is not None:
                on_plan(step)
            if on_fallback_in_call is not None:
                on_fallback_in_call(step)
            return step.run

        step.run.on_untraceable = untraceable
    except CaptureError as err:
        step.run = _fallback(module, err, budget_bytes, step)
        step.checked = True
        if on_plan is not None:
            on_plan(step)
    return step


def _not_built(args: tuple, kwargs: dict) -> Any:
    raise AssertionError("remat_plugin: a planned step ran before it was built")


def _fallback(module: nn.Module, err: CaptureError, budget_bytes: int,
              step: PlannedStep) -> Callable[[tuple, dict], Any]:
    """Per-layer checkpointing of each list of the model's repeated layers, when the model has no graph."""
    if not err.fallback:
        raise err
    chains = find_layer_chains(module)
    if not chains:
        raise CaptureError(f"{err} (and no list of repeated layers to fall back on)") from err
    step.plan = fallback_plan(str(err), chains, budget_bytes, step.signature_key)
    step.to_meter = True  # NOTE [metered fallback]
    return CheckpointedRun(module, [layer for _, layers in chains for layer in layers])


def fallback_step(module: nn.Module, call: Call, plan: Plan) -> PlannedStep:
    """The step of a fallback ``plan`` made elsewhere (rank 0, a larger bucket): per-layer checkpointing, no
    capture."""
    chains = find_layer_chains(module)
    if not chains:
        raise CaptureError(f"remat_plugin.runtime: the plan is a fallback ({plan.fallback}), but "
                           f"{type(module).__name__} has no list of repeated layers here to checkpoint")
    run = CheckpointedRun(module, [layer for _, chain in chains for layer in chain])
    # NOTE [metered fallback]: a plan metered at the shapes of a bucket covering this call checkpoints the layers
    # it chose; one not metered yet is metered before this step's first call
    sized = plan.predicted_peak_bytes >= 0 and len(plan.blocks) == len(run.layers)
    if sized:
        chosen = [b.index for b in plan.blocks if b.mode == "checkpoint"]
        run.order = chosen + [i for i in range(len(run.layers)) if i not in chosen]
        run.count = len(chosen)
    return PlannedStep(run=run, signature_key=call.key, plan=plan, checked=True, tensor_ids=call.tensor_ids,
                       to_meter=not sized)


def replay_step(module: nn.Module, call: Call, plan: Plan, budget_bytes: int,
                options: ExecutionOptions = EAGER) -> PlannedStep:
    """A step running ``plan``'s schedule on this call; its first call raises :class:`PlanMismatch`
    (before running anything) if the graph differs or the schedule would exceed ``budget_bytes``."""
    if plan.fallback or not plan.graph_key:
        raise PlanMismatch("the plan has no schedule to replay")
    step = PlannedStep(run=_not_built, signature_key=call.key, plan=plan, tensor_ids=call.tensor_ids)

    def check_and_emit(joint: JointGraph):
        key = joint.structure_key
        if key != plan.graph_key:
            raise PlanMismatch(f"graph {key} is not the plan's graph {plan.graph_key}")
        # sizes decide the fit, with the scratch of the ops that had some; times are the plan's
        problem = joint.to_problem({}, scratch_of(joint, dict(plan.scratch_ops), call.device))
        try:
            sim = simulate(problem, Schedule(plan.schedule))
        except InvalidScheduleError as exc:
            raise PlanMismatch(f"the schedule does not run on this graph: {exc}") from exc
        usable = budget_bytes - safety_margin(budget_bytes)
        if sim.peak_bytes > usable:
            raise PlanMismatch(f"predicted peak {human_bytes(sim.peak_bytes)} exceeds {human_bytes(usable)}")
        step.plan = dataclasses.replace(plan, predicted_peak_bytes=sim.peak_bytes, planning_s=0.0,
                                        signature=call.key, planning_stages=())
        step.checked = True
        return emit_programs(joint, Schedule(plan.schedule))

    step.run = build_step(module, call.args, call.kwargs, check_and_emit, call.device,
                          frozenset(plan.dropped_outputs), options, frozenset(plan.ungraded_outputs))
    return step


def written_inputs(run: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The call's tensors the step's forward writes into (NOTE [inputs written by the forward]), for runs that
    must leave them as they were."""
    exported = getattr(run, "exported", None)
    positions = exported.meta.get(MUTATED_INPUTS_META, ()) if exported is not None else ()
    if not positions:
        return []
    leaves = pytree.tree_leaves((args, kwargs))
    return [leaves[i] for i in sorted(positions) if isinstance(leaves[i], torch.Tensor)]


def run_unobserved(module: nn.Module, step: PlannedStep, call: Call) -> None:
    """Run ``step`` once on ``call`` without a trace (buffers and RNG restored, outputs dropped): it plans.

    The caller's dispatch and function modes are suspended: capture traces fake tensors, and
    profiling is not the user's step.
    """
    with suspended_user_modes(), unobserved(module, call.device, written_inputs(step.run, call.args, call.kwargs)), \
            step.planning_only():
        step(call.args, call.kwargs)


def capture_problem(module: nn.Module, args: tuple = (), kwargs: dict | None = None, progress=None,
                    op_timings: OpTimings | None = None) -> tuple[Problem, set[str]]:
    """Capture and profile ``module`` on these inputs; return ``(problem, constants)`` without planning.

    For solver studies, the batch-size search and the CLI: the problem is what
    :func:`~remat_plugin.runtime.module.rematerialize` plans on.  Runs no forward: tracing
    stops once the problem is built, so the step's memory is never spent (the batch-size
    search captures sizes above the budget).  Profiling runs one op at a time (RNG and
    buffers restored afterwards).
    """
    captured = captured_problem(module, args, kwargs, progress, op_timings)
    return captured.problem, captured.constants


@dataclass(frozen=True)
class CapturedProblem:
    """What :func:`captured_problem` returns: the problem, its constants, the joint graph's structure key (which a
    plan needs to be replayed) and the outputs the capture gave no gradient."""

    problem: Problem
    constants: set[str]
    graph_key: str
    ungraded_outputs: frozenset[int] = frozenset()


def captured_problem(module: nn.Module, args: tuple = (), kwargs: dict | None = None, progress=None,
                     op_timings: OpTimings | None = None, *, ungrade_beside_the_loss: bool = False) -> CapturedProblem:
    """:func:`capture_problem`, with the joint graph's structure key.

    ``ungrade_beside_the_loss``: where the call returns one floating scalar (the loss) beside other tensors, capture
    the step that gives those others no gradient, as a first plan that steps down runs it (NOTE [loss-only first
    plan] in :mod:`remat_plugin.runtime.resolver`); :attr:`CapturedProblem.ungraded_outputs` says which.
    """
    call = Call.of(module, tuple(args), dict(kwargs or {}))
    found: dict[str, Any] = {}

    def record(joint: JointGraph):
        if progress is not None:
            progress.stage(f"profile {len(joint.ops)} ops" if call.device.type != "meta" else "estimate op costs")
        found["problem"], found["constants"] = measured_problem(joint, call.device, progress, op_timings)
        found["graph_key"] = joint.structure_key
        raise _ProblemCaptured  # nothing is compiled or run

    if progress is not None:
        progress.stage("capture")
    run = build_step(module, call.args, call.kwargs, record, call.device, ungrade_beside_the_loss=ungrade_beside_the_loss)
    try:
        with suspended_user_modes(), unobserved(module, call.device, written_inputs(run, call.args, call.kwargs)):
            run(call.args, call.kwargs)
    except _ProblemCaptured:
        pass
    if "problem" not in found:
        raise AssertionError("remat_plugin.capture: the trace ended without building the problem")
    return CapturedProblem(found["problem"], found["constants"], found["graph_key"], run.ungraded_outputs)


class _ProblemCaptured(Exception):
    """Raised by :func:`capture_problem` once its problem is built, to end the trace there."""
