"""FSDP2 (``fully_shard``): planned rematerialization inside each leaf FSDP unit, the budget per rank.

NOTE [FSDP2 units]
    ``fully_shard(m)`` makes ``m`` a unit: before its forward a hook all-gathers its parameters
    and registers the unsharded Parameters on ``m``; after it (``reshard_after_forward``) their
    memory is freed, and hooks on its outputs gather them again before its backward; its
    gradients are reduce-scattered once its backward has run.  We plan each *leaf* unit (no unit
    inside it): its ``forward`` becomes a planned step of its own class's forward
    (:class:`UnitBody`), which runs between FSDP's hooks.  So the step reads the unsharded
    Parameters, its recomputation runs inside the unit's backward (when FSDP has gathered them
    again), and FSDP's all-gathers, reduce-scatters and their order are those of the run without
    us.  Outside the leaf units (embeddings, the head, the loss) the model runs as written.
    Leaf units of one class called with one input signature, their modules in the same train/eval
    modes, form a group: one problem, solved once (on rank 0), its plans (NOTE [FSDP2 budget])
    replayed by the same units on every rank.  A training step is told by the model's mode: a unit
    put in eval mode in a training model is planned (in a group of its own); an eval-mode model
    runs its units as written (NOTE [eval-mode backward]).

NOTE [FSDP2 budget]
    The budget is per rank: what one forward+backward may add to what that rank has allocated.
    The units' plans are known exactly (the simulator); the rest of the step (FSDP's gathered
    parameters, the activations and gradients outside the units) is measured.  The first step of
    new input shapes captures each group (rank 0 profiles and solves) and runs every unit's
    lowest-peak plan.  In a chain of ``n`` units what counts is not one unit's peak but
    ``n * kept + (peak - kept)``: every unit's kept bytes (what its forward leaves for its backward)
    are alive at once, one unit's working memory on top.  So before the next step rank 0 gives each
    new group the plan lowest by that measure it finds (:func:`chained_plan`: the chain DP at
    several budgets, then single-block swaps judged by the simulator).  An unobserved forward+backward of the whole model (buffers, RNG and
    ``.grad`` restored, as for NOTE [calibration]) is then metered at the allocator, the highest
    peak of all ranks taken, and rank 0 gives the groups the fastest plans whose extra memory
    bound, ``sum_g n_g * dk_g + max_g(max(0, dw_g))`` (``dk``, ``dw``: kept and working bytes over
    those of the lowest plan; ``n_g``: the group's calls per step), fits what is left under the
    budget.  Another metered step checks them: above the budget's usable part (less the safety margin and,
    on CUDA, the allocator's slack: NOTE [allocator slack]), the units go back to the plans metered before
    (with a warning the first time).  The bound is an upper estimate (every unit's
    extra kept bytes and one unit's working memory at the step's peak at once): where the meter
    shows less than it, the allowance is scaled by bound / measured (at most doubled) and the plans
    chosen and metered again, up to :data:`MAX_CHOICES` times.  A group's faster plan may go to
    only its last units, so a coarse set of plans still spends the allowance.  If the lowest plans already measure above
    the budget, :class:`InfeasibleBudgetError` says so with the measured peak.  These unobserved
    steps (two to four per new input shape) are the price of a measured, not guessed, remainder.
    gloo (CPU) reduce-scatters a clone of its input on its own thread and frees the clone when that
    thread is done, so whether one unit's gradients are alive twice at the peak is a race (gpt2-tiny:
    6.0 MiB more in some steps than in others of the same plan).  The metered peak leaves those
    clones out and, under gloo, adds one unit's unsharded gradients (:attr:`FsdpRemat.in_flight_bytes`)
    instead: the worst case, every time.  gloo's thread may also free a unit's all-gather output after
    FSDP2's backward dropped it, where the profiler does not see the free: the meter takes it as freed
    where FSDP2 dropped it (:func:`step_peak`, NOTE [unseen frees]).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from remat_plugin.capture.export import ExecutionOptions
from remat_plugin.capture.forward_swap import ForwardSwap
from remat_plugin.capture.memory_meter import (
    FreedAfter,
    allocator_slack,
    allocator_trace,
    memory_profile,
    warm_backward_workspaces,
)
from remat_plugin.capture.module_attributes import say_changed
from remat_plugin.capture.output_usage import loss_index, tensor_leaves, when_backward_starts
from remat_plugin.errors import InfeasibleBudgetError, RematError, human_bytes
from remat_plugin.ir.plan import Plan, budget_for_peak, safety_margin
from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import simulate
from remat_plugin.planning.choose_plan import chained_plan, make_plan
from remat_plugin.planning.menus import DEFAULT_ILP_TIME_LIMIT_S
from remat_plugin.runtime import dist
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.hf_cache import cache_off, say_packing_honoured
from remat_plugin.runtime.reporting import announce
from remat_plugin.runtime.side_effects import unobserved
from remat_plugin.runtime.signature import Call
from remat_plugin.runtime.steps import PROCESS_CACHES, PlannedStep, PlanningCaches, captured_problem, replay_step
from remat_plugin.runtime.unplanned_calls import is_planned_call, run_unplanned
from remat_plugin.torch_private import profiler_active, suspended_user_modes

log = logging.getLogger(__name__)

# A unit's outputs must not be views (FSDP's pre-backward hook on a view is lost to a caller's in-place op): no watch.
UNIT_OPTIONS = ExecutionOptions(watch_outputs=False)
MAX_CHOICES = 3  # plans chosen and metered per new input shape, after the lowest plans' metered step
GLOO_COPIES = ("c10d::_reduce_scatter_base_", "c10d::reduce_scatter_")  # ops whose input gloo clones (NOTE [FSDP2 budget])
# In backward FSDP2 drops a unit's all-gather output as its copy-out ends; gloo's thread may free it later, unseen
ALL_GATHER_OUTPUTS = FreedAfter("FSDP::all_gather", "FSDP::all_gather_copy_out", only_inside="FSDP::pre_backward")


def step_peak(prof: torch.profiler.profile, device: torch.device | str = "cpu") -> int:
    """A finished session's allocator peak rise as the units' plans count it (NOTE [FSDP2 budget]): gloo's
    reduce-scatter clones left out (:func:`in_flight_bytes` counts them), all-gather outputs freed where FSDP2
    dropped them (NOTE [unseen frees])."""
    return allocator_trace(prof, device, excluding=GLOO_COPIES, freed_after=(ALL_GATHER_OUTPUTS,)).peak_rise()[0]


def in_flight_bytes(units: Iterable[nn.Module]) -> int:
    """Under gloo, one leaf unit's unsharded gradients: a reduce-scatter's clone a step may hold or not
    (NOTE [FSDP2 budget]); 0 under a backend that does not copy collective inputs."""
    if not dist.copies_collective_inputs():
        return 0
    return max(sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in units)


def leaf_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The ``fully_shard`` units of ``model`` with no unit inside them, in module order."""
    return [(name, m) for name, m in model.named_modules()
            if _is_unit(m) and not any(_is_unit(inner) for inner in list(m.modules())[1:])]


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


def _group_key(body: UnitBody, call: Call) -> str:
    """The group a unit's call joins: its input signature and the train/eval mode of each of its modules (a unit
    with a dropout turned off by ``.eval()`` traces another graph than its siblings)."""
    return call.key + "|modes:" + "".join("t" if m.training else "e" for m in body.unit.modules())


class UnitBody(nn.Module):
    """A unit's own class forward, without the unit's FSDP hooks: what is captured and planned."""

    def __init__(self, unit: nn.Module):
        super().__init__()
        self.unit = unit

    def forward(self, *args, **kwargs):
        return type(self.unit).forward(self.unit, *args, **kwargs)


@dataclass
class UnitGroup:
    """Leaf units of one class called with one input signature: one problem; its lowest plan, and a faster
    one for its last units when the budget leaves room."""

    key: str
    floor: Plan  # the unit's lowest-peak plan alone: what the first step runs
    lowest: Plan  # lowest in ``calls * kept + (peak - kept)`` (:func:`chained_plan`): what a metered step starts from
    plan: Plan  # what the units in ``faster`` run; the others run ``lowest``
    faster: frozenset[int] = frozenset()  # unit indices running ``plan``
    settled: bool = False  # its plans chosen for a metered step (NOTE [FSDP2 budget])
    steps: dict[int, PlannedStep] = field(default_factory=dict)  # unit index -> its step of its plan
    units: list[int] = field(default_factory=list)  # unit indices called, in the order first seen
    calls: int = 0  # calls in the step under way
    per_step: int = 0  # calls in the last whole step

    def plan_of(self, index: int) -> Plan:
        return self.plan if index in self.faster else self.lowest

    def run(self, plan: Plan, count: int) -> None:
        """``plan`` for the last ``count`` units in module order, ``lowest`` for the others."""
        self.plan, self.faster = plan, frozenset(sorted(self.units)[len(self.units) - count:]) if count else frozenset()


class FsdpRemat:
    """Planned rematerialization of ``model``'s leaf FSDP2 units under a per-rank ``budget``; see the module docstring.

    Installed at construction (each leaf unit's ``forward`` and a pre-forward hook on ``model``);
    :meth:`remove` restores the model.  ``plans`` maps each group's input signature to the plan
    its units run; ``measured_peaks`` lists the metered steps' peaks (highest over ranks).
    """

    def __init__(self, model: nn.Module, budget: int | str = "80%", *,
                 ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S, caches: PlanningCaches | None = None):
        units = leaf_units(model)
        if not units:
            raise RematError(f"remat_plugin.fsdp: {type(model).__name__} has no fully_shard unit. Apply fully_shard to "
                             "its layers (and then to the model) before this, or use rematerialize() for a model that "
                             "is not sharded")
        parse_budget(budget)  # a malformed budget fails here, not at the first step
        self.model = model
        self.budget = budget
        self.ilp_time_limit_s = ilp_time_limit_s
        self.caches = caches or PROCESS_CACHES
        self.unit_names = [name for name, _ in units]
        self.groups: dict[str, UnitGroup] = {}
        self.measured_peaks: list[int] = []
        self._bodies = [UnitBody(m) for _, m in units]
        self._units = [m for _, m in units]
        self._problems: dict[str, tuple[Problem, set[str]]] = {}  # rank 0: each group's problem
        self._device = torch.device("cpu")
        self._metering = False
        self._swaps = [ForwardSwap(m, functools.partial(self._forward_for, i)) for i, (_, m) in enumerate(units)]
        self._held: frozenset[int] = frozenset()  # model outputs (tensor positions) a caller held through backward
        self._hooks = [model.register_forward_pre_hook(self._step_starts, prepend=True, with_kwargs=True),
                       model.register_forward_hook(self._step_outputs)]
        # The key/value cache a transformers model returns cannot be captured (NOTE [training without the cache]):
        # off while installed, as the Lightning and Accelerate adapters have it, and back on at remove().
        self._cache = contextlib.ExitStack()
        turned_off = self._cache.enter_context(cache_off(model, {}))
        self._cache_turned_off = bool(turned_off)
        if turned_off:
            announce(f"remat_plugin.fsdp: setting use_cache=False on {', '.join(turned_off)} (a training step has no "
                     "use for the key/value cache, which cannot be captured; remove() sets it back)")

    @property
    def in_flight_bytes(self) -> int:
        """:func:`in_flight_bytes` of these units."""
        return in_flight_bytes(self._units)

    @property
    def plans(self) -> dict[str, Plan]:
        return {key: g.plan for key, g in self.groups.items()}

    def remove(self) -> None:
        """Put the units' forwards back and remove the hook: the model runs as before."""
        for swap in reversed(self._swaps):
            swap.restore()
        for hook in self._hooks:
            hook.remove()
        self._cache.close()

    def kept_bytes(self, key: str, plan: Plan) -> int | None:
        """What ``plan`` keeps from a unit's forward for its backward (rank 0, which planned; None elsewhere)."""
        if key not in self._problems:
            return None
        return simulate(self._problems[key][0], Schedule(plan.schedule)).kept_bytes

    # --- the step ---------------------------------------------------------------------------
    def _step_starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before a training step, settle the plans of groups the last step found (NOTE [FSDP2 budget])."""
        if self._metering or not (module.training and torch.is_grad_enabled()):
            return
        say_packing_honoured(module, kwargs, self._cache_turned_off)  # NOTE [packed sequences without the cache]
        for g in self.groups.values():
            g.per_step, g.calls = (g.calls or g.per_step), 0
        try:
            self._settle_new(args, kwargs)
        finally:
            for g in self.groups.values():
                g.calls = 0

    def _settle_new(self, args: tuple, kwargs: dict) -> None:
        new = [g for g in self.groups.values() if not g.settled]
        if not new:  # the same on every rank: every rank called the same units
            return
        if any(dist.all_gather(profiler_active())):
            log.warning("remat_plugin.fsdp: a profiler is recording, so the step cannot be metered; the units keep "
                        "their lowest-peak plans until a step starts without it")
            return
        self._lower(new)
        budget = parse_budget(self.budget, self._device)
        peak = self._metered_step(args, kwargs)
        if peak > budget:
            raise InfeasibleBudgetError(budget, budget_for_peak(peak), what="FSDP step with every unit at its "
                                        "lowest-peak plan (measured)")
        self._settle(new, args, kwargs, budget, peak)
        for g in new:
            g.settled = True

    def _settle(self, groups: list[UnitGroup], args: tuple, kwargs: dict, budget: int, lowest_peak: int) -> None:
        """Choose, meter, and choose again with the bound rescaled by what the meter showed (NOTE [FSDP2 budget])."""
        # A chosen set is kept only if its metered peak leaves the margin and the allocator's slack free: the next
        # steps of the same plans measure differently (NOTE [allocator slack]), and the budget is theirs.
        usable = budget - safety_margin(budget) - allocator_slack(self._device)
        room = usable - lowest_peak  # what the lowest plans leave of the budget
        allowance = room
        accepted = {g.key: (g.plan, len(g.faster)) for g in groups}
        for attempt in range(MAX_CHOICES):
            predicted = self._choose(groups, allowance)
            if predicted is None:  # the same plans as the last metered ones
                return
            peak = self._metered_step(args, kwargs)
            if peak > usable:
                say = log.warning if attempt == 0 else log.info
                say("remat_plugin.fsdp: the units' chosen plans measured %s, %s over the %s usable of the budget of %s; "
                    "they keep the plans metered before", human_bytes(peak), human_bytes(peak - usable),
                    human_bytes(usable), human_bytes(budget))
                for g in groups:
                    g.run(*accepted[g.key])
                return
            accepted = {g.key: (g.plan, len(g.faster)) for g in groups}
            # the bound over what the meter showed, at most doubling the allowance per round
            grown = min(2 * allowance, room * predicted // max(peak - lowest_peak, 1))
            if grown <= allowance * 21 // 20:  # the bound was not loose: nothing more to gain
                return
            allowance = grown

    def _metered_step(self, args: tuple, kwargs: dict) -> int:
        """One forward+backward of the model on these inputs, unobserved; its allocator peak, highest of all ranks.

        Buffers, the RNG streams and the parameters' ``.grad`` are left as they were.  The backward
        starts from the first scalar output (the loss), else the sum of the first differentiable one;
        the other outputs are dropped before it, as ``loss = model(...).loss`` does, unless a caller's
        step was seen holding them (:meth:`_step_outputs`).
        """
        params = list(self.model.parameters())
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        for g in self.groups.values():
            g.calls = 0
        self._metering = True
        warm_backward_workspaces(self._device)  # cuBLAS's one-time blocks are not the step's (calibration's reason)
        try:
            with suspended_user_modes(), unobserved(self.model, self._device), \
                    memory_profile(cuda=self._device.type == "cuda") as prof:
                outputs = tensor_leaves(self.model(*args, **kwargs))
                root = loss_index(outputs)
                if root is not None:
                    loss = outputs[root] if outputs[root].numel() == 1 else outputs[root].sum()
                    held = [t for i, t in enumerate(outputs) if i in self._held]  # what callers were seen holding
                    del outputs
                    loss.backward()
                    del loss, held
            peak = step_peak(prof, self._device)  # plus ``in_flight_bytes`` below
        finally:
            self._metering = False
            for p, grad in zip(params, grads):
                p.grad = grad
        peak = max(dist.all_gather(peak))
        self.measured_peaks.append(peak)
        return peak + self.in_flight_bytes

    def _step_outputs(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Watch which outputs the caller still holds when its backward starts; one not metered so re-settles."""
        if self._metering or not (module.training and torch.is_grad_enabled()):
            return
        outputs = tensor_leaves(output)
        root = loss_index(outputs)
        if root is None:
            return

        def seen(now_held: frozenset[int], sizes: tuple[int, ...]) -> None:
            held = now_held - {root} - self._held
            if held and any(g.settled for g in self.groups.values()):
                log.warning("remat_plugin.fsdp: the step held model outputs %s (%s) through backward, which the "
                            "metered step had dropped; this step may have exceeded the budget by up to that much. "
                            "The units' plans are chosen again before the next step", sorted(held),
                            human_bytes(sum(sizes[i] for i in held)))
                for g in self.groups.values():
                    g.settled = False
            self._held |= held

        when_backward_starts(outputs, root, seen)

    def _forward_for(self, index: int, real_forward: Callable) -> Callable:
        def forward(*args, **kwargs):
            # The model's mode, not the unit's, tells a training step: a unit put in eval mode to freeze its
            # dropout is planned (in a group of its own), as rematerialize plans such submodules.
            if not is_planned_call(self.model):
                return run_unplanned(self.model, real_forward, args, kwargs)
            return self._run_unit(index, args, kwargs)

        forward.__wrapped__ = real_forward  # type: ignore[attr-defined]
        return forward

    def _run_unit(self, index: int, args: tuple, kwargs: dict) -> Any:
        body = self._bodies[index]
        call = Call.of(body, args, kwargs)
        self._device = call.device
        key = _group_key(body, call)
        group = self.groups.get(key) or self._new_group(body, call, key)
        group.calls += 1
        if index not in group.units:
            group.units.append(index)
        plan = group.plan_of(index)
        step = group.steps.get(index)
        # FSDP registered other unsharded Parameters, the unit's plan changed, or a Python value the graph holds
        # (NOTE [module attributes])
        changed = step.changed_values() if step is not None else []
        if changed:
            say_changed(body.unit, changed)
        if step is None or step.tensor_ids != call.tensor_ids or step.plan is None or \
                step.plan.schedule != plan.schedule or changed:
            step = group.steps[index] = replay_step(body, call, plan, plan.budget_bytes, UNIT_OPTIONS)
        return step(call.args, call.kwargs)

    # --- planning -------------------------------------------------------------------------
    def _new_group(self, body: UnitBody, call: Call, key: str) -> UnitGroup:
        def lowest_plan() -> Plan:
            captured = captured_problem(body, call.args, call.kwargs, op_timings=self.caches.op_timings)
            self._problems[key] = (captured.problem, captured.constants)
            with _one_layer_is_one_block():
                return dataclasses.replace(self._solve(captured.problem, captured.constants, 1),
                                           graph_key=captured.graph_key)

        lowest = dist.from_rank_zero(lowest_plan, f"planning the FSDP unit {type(body.unit).__name__}")
        group = self.groups[key] = UnitGroup(key, lowest, lowest, lowest)
        return group

    def _solve(self, problem: Problem, constants: set[str], budget_bytes: int) -> Plan:
        """The fastest plan under ``budget_bytes``, or the lowest-peak plan when nothing fits it."""
        try:
            plan, _ = make_plan(problem, constants, budget_bytes, self.ilp_time_limit_s, planners=self.caches.planners)
        except InfeasibleBudgetError as exc:
            plan, _ = make_plan(problem, constants, exc.min_feasible_bytes, self.ilp_time_limit_s,
                                planners=self.caches.planners)
        return plan

    def _lower(self, groups: list[UnitGroup]) -> None:
        """Give each group its plan lowest in ``calls * kept + (peak - kept)`` (NOTE [FSDP2 budget])."""

        def lowest() -> dict[str, Plan]:
            chosen = {}
            for g in groups:
                problem, constants = self._problems[g.key]
                plan = chained_plan(problem, constants, max(g.per_step, 1), ilp_time_limit_s=self.ilp_time_limit_s,
                                    planners=self.caches.planners)
                chosen[g.key] = dataclasses.replace(plan, graph_key=g.floor.graph_key)
            return chosen

        chosen = dist.from_rank_zero(lowest, "choosing the FSDP units' lowest plans")
        for g in groups:
            g.lowest = chosen[g.key]
            g.run(g.lowest, 0)

    def _choose(self, groups: list[UnitGroup], allowance: int) -> int | None:
        """Rank 0 gives the groups their fastest plans whose bound, ``sum_g n_g * dk_g + max_g(max(0, dw_g))``,
        is at most ``allowance``, shared by their calls (NOTE [FSDP2 budget]); the bound of the plans chosen,
        or None if they are those the groups run already.  A faster plan may go to only some of a group's
        units (the last ones): ``n_g`` is then their calls, so a coarse menu still spends the allowance."""

        def choose() -> tuple[dict[str, tuple[Plan, int]], int]:
            calls = sum(g.per_step for g in groups)
            chosen, extra_kept, extra_work = {}, 0, 0
            for g in groups:
                problem, constants = self._problems[g.key]
                low = simulate(problem, Schedule(g.lowest.schedule))
                n = len(g.units)
                each = max(1, g.per_step // max(n, 1))  # calls per unit
                best: tuple[float, Plan, int, Any] = (n * each * g.lowest.predicted_time_ms, g.lowest, 0, low)
                for m in sorted({n, -(-3 * n // 4), -(-n // 2), -(-n // 4), 1}, reverse=True):
                    plan = chained_plan(problem, constants, m * each, allowance * g.per_step // calls, g.lowest,
                                        self.ilp_time_limit_s, self.caches.planners)
                    ms = each * (m * plan.predicted_time_ms + (n - m) * g.lowest.predicted_time_ms)
                    if ms < best[0]:
                        best = (ms, dataclasses.replace(plan, graph_key=g.lowest.graph_key), m,
                                simulate(problem, Schedule(plan.schedule)))
                _, plan, m, sim = best
                chosen[g.key] = (plan, m)
                extra_kept += m * each * (sim.kept_bytes - low.kept_bytes)
                if m:
                    extra_work = max(extra_work, (sim.peak_bytes - sim.kept_bytes) - (low.peak_bytes - low.kept_bytes))
            return chosen, extra_kept + extra_work

        chosen, bound = dist.from_rank_zero(choose, "choosing the FSDP units' plans")
        changed = False
        for g in groups:
            plan, m = chosen[g.key]
            if (plan.schedule, m) != (g.plan.schedule, len(g.faster)):
                g.run(plan, m)
                changed = True
        return bound if changed else None


class _GlueNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if "a block holds more than" not in record.getMessage():
            return True
        log.debug("remat_plugin.fsdp: %s", record.getMessage())
        return False


@contextlib.contextmanager
def _one_layer_is_one_block() -> Iterator[None]:
    """The planner warns when one block holds most of a graph (a model glued together); a unit is one layer,
    so that is no news there: said at DEBUG instead."""
    menus_log, note = logging.getLogger("remat_plugin.planning.menus"), _GlueNote()
    menus_log.addFilter(note)
    try:
        yield
    finally:
        menus_log.removeFilter(note)


def rematerialize_fsdp(model: nn.Module, budget: int | str = "80%", *,
                       ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S) -> FsdpRemat:
    """Plan ``model``'s leaf ``fully_shard`` units under ``budget`` per rank (NOTE [FSDP2 units], [FSDP2 budget]).

    Call it on every rank after ``fully_shard``; training then runs as before.  The first step of
    each input signature plans the units (rank 0) and runs their lowest-peak plans, the next one
    is metered and chooses faster plans for the memory left, the one after checks them.
    """
    return FsdpRemat(model, budget, ilp_time_limit_s=ilp_time_limit_s)
