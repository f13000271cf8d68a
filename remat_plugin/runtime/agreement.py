"""Rank agreement: with several processes, every rank runs the plan rank 0 made.

Every training call, ranks gather each other's signature key: that one ``all_gather`` is all a
call costs once every rank has a step for its shapes.  When all need a step for the same new
shapes, rank 0 makes the plan with the smallest budget of all ranks and broadcasts it, and
the others replay it -- a fallback plan too: every rank then checkpoints the same layers.
Ranks that see different shapes plan their own (warned once).

Whatever fails while a step is made -- a budget on any rank, planning on rank 0 (an
out-of-memory while profiling as much as a :class:`RematError`), a rank's replay of rank 0's
plan -- is raised on every rank with its message, at the same collective: no rank is left
waiting for a plan that never comes (NOTE [a failure reaches every rank] in
:mod:`~remat_plugin.runtime.dist`).  A call that makes a step adds two or three collectives
to that ``all_gather``; a call that has one adds none.

The ``all_gather`` also carries what each rank's caller did with the previous call's outputs:
when every rank drops an output, or takes no gradient of it, rank 0 plans those shapes again
for it and every rank runs the new plan (NOTE [output usage] in
:mod:`~remat_plugin.runtime.resolver`); every rank decides that alike from the same gathered data.
A step agreed on is metered on every rank before its first call runs, and corrected together
(NOTE [calibration]): one more collective per new plan.

A first plan that keeps only the loss (NOTE [loss-only first plan] in :mod:`~remat_plugin.runtime.resolver`)
is made only here, by rank 0 for every rank: its backward gathers every rank's verdict on what the callers did
with the outputs, so all ranks must run it.  A call where ranks see different shapes while one of them would
run such a plan raises on every rank, with the fix.
"""
from __future__ import annotations

import functools
import logging

from remat_plugin.capture.output_usage import OutputUsage
from remat_plugin.errors import RematError, human_bytes
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime import dist
from remat_plugin.runtime.calibration import metered_step
from remat_plugin.runtime.resolver import BudgetFn, StepResolver
from remat_plugin.runtime.signature import Call, describe
from remat_plugin.runtime.steps import PlannedStep
from remat_plugin.torch_private import profiler_active

log = logging.getLogger(__name__)


class RankAgreement:
    """Agrees on steps across ranks for one :class:`StepResolver`; see the module docstring."""

    def __init__(self, resolver: StepResolver):
        self.resolver = resolver
        self._warned = False
        self._to_meter: set[str] = set()  # keys of steps agreed and not yet metered (NOTE [calibration])
        # The plan rank 0 sent, by key: identical on every rank (a replaying rank's own step predicts its peak
        # without rank 0's measured scratch), so decisions made from it are the same everywhere.
        self._agreed: dict[str, Plan] = {}

    def step_for(self, call: Call, budget: BudgetFn) -> PlannedStep:
        """The step this rank runs for this call: rank 0's plan when all ranks see the same shapes, else its own."""
        known = self.resolver.known_step(call)  # None too when parameters were replaced since it was built
        usage = known.take_usage() if known is not None else None
        solved_here = known is not None and known.problem is not None
        stepped_down = known.plan.loss_only_floors if known is not None and known.plan is not None else ()
        gathered = dist.all_gather((call.key, known is not None, usage, solved_here, stepped_down))
        same_shapes = len({key for key, *_ in gathered}) == 1
        if not same_shapes:
            _refuse_stepped_down_apart(gathered)
        if known is not None and all(have for _, have, *_ in gathered):
            outputs = self._agreed_outputs(call, gathered) if same_shapes else None
            if outputs is None:
                return known
            # The re-plan keeps its plan's budget (at most): under DDP the call after the first also rebuilds the
            # reducer's gradient buckets, an allocation the plan does not model, which that budget's headroom
            # (the optimizer state then still to come) absorbed.
            return self._agreed_step(call, budget, outputs, cap_bytes=self._agreed[call.key].budget_bytes)
        if same_shapes:
            return self._agreed_step(call, budget)
        if not self._warned:
            log.warning("remat_plugin: ranks see different input shapes; each rank plans its own shapes")
            self._warned = True
        return dist.on_every_rank(lambda: self.resolver.step_for(call, budget), "planning its own input shapes")

    def _agreed_outputs(self, call: Call, gathered: list) -> tuple[frozenset[int], frozenset[int]] | None:
        """The outputs every rank's caller drops or takes no gradient of, when rank 0's plan should be made
        again for them (NOTE [output usage] in :mod:`~remat_plugin.runtime.resolver`); the same on every rank,
        from what every rank saw."""
        usages = [usage for _, _, usage, *_ in gathered]
        plan = self._agreed.get(call.key)
        if plan is None or plan.fallback or any(u is None for u in usages):
            return None
        return self.resolver.outputs_to_plan(call, plan, OutputUsage.combined(usages), gathered[0][3])

    def _agreed_step(self, call: Call, budget: BudgetFn, outputs: tuple[frozenset[int], frozenset[int]] | None = None,
                     cap_bytes: int | None = None) -> PlannedStep:
        """All ranks need a step for the same shapes (``outputs``: again, for the outputs their callers drop or
        take no gradient of, within ``cap_bytes``): rank 0 decides the plan, every rank runs it."""
        budget_bytes = min(dist.gathered(budget, "computing its budget"))
        if cap_bytes is not None:
            budget_bytes = min(budget_bytes, cap_bytes)
        made: list[PlannedStep] = []  # on rank 0, the step planning built (when the bucket is the call's shapes)

        def plan_on_rank_zero() -> str:
            if outputs is not None:
                solved = self.resolver.solve(call, budget_bytes, now=True, dropped_outputs=outputs[0],
                                             ungraded_outputs=outputs[1], refine=True)
                made.append(solved)
                assert solved.plan is not None
                return solved.plan.to_json()
            step = self.resolver.replay_known(call, budget_bytes)
            if step is not None:
                plan = step.plan
            else:
                plan, step = self.resolver.solve_bucket(call, budget_bytes)
            assert plan is not None
            if step is not None:
                made.append(step)
            return plan.to_json()

        with self.resolver.planning_for_every_rank():  # what rank 0 plans here, every rank runs
            plan = Plan.from_json(dist.from_rank_zero(plan_on_rank_zero, "planning"))

        def run_it_here() -> PlannedStep:
            if made:
                return made[0]
            if not dist.is_rank_zero():
                self.resolver.adopt(plan.signature, plan)
            return self.resolver.replay(plan, call, budget_bytes)

        step = self.resolver.steps[call.key] = dist.on_every_rank(run_it_here, "building its step of rank 0's plan")
        self._to_meter.add(call.key)
        self._agreed[call.key] = plan
        return step

    def calibrated(self, call: Call, step: PlannedStep, budget: BudgetFn) -> PlannedStep:
        """``step``, metered on every rank before its first call runs, or the plan that metering called for.

        NOTE [calibration] (:mod:`~remat_plugin.runtime.calibration`) across ranks: each rank meters its
        own step; the highest peak decides, alike on every rank (the same plan, the same measurements),
        whether rank 0 plans again with the gap kept back.  A caller's profiler on any rank defers it.
        """
        while call.key in self._to_meter:
            plan = self._agreed[call.key]
            if plan.fallback:  # NOTE [metered fallback]: every rank meters, the highest peak decides alike
                if not any(dist.all_gather(step.to_meter)):  # rank 0 metered the bucket's plan every rank runs
                    self._to_meter.discard(call.key)
                    return step
                if any(dist.all_gather(profiler_active())):
                    return step
                self._to_meter.discard(call.key)
                step.to_meter = False
                self.resolver.size_fallback(call, step, functools.partial(self._highest_peak, call, step))
                return step

            results = dist.gathered(functools.partial(self._meter, call, step), "metering its step")
            if any(deferred for deferred, _ in results):
                return step
            self._to_meter.discard(call.key)
            measured = max((peak for _, peak in results if peak is not None), default=None)
            outputs = (frozenset(plan.dropped_outputs), frozenset(plan.ungraded_outputs))
            replanned = self.resolver.calibration.replanned(call, plan, measured, functools.partial(
                self._agreed_step, call, budget, outputs, cap_bytes=plan.budget_bytes))
            if replanned is None:
                return step
            step = replanned
        return step

    def _highest_peak(self, call: Call, step: PlannedStep) -> int | None:
        """Every rank's metered peak of ``step``, the highest (None if no rank could meter it)."""
        results = dist.gathered(functools.partial(self._meter, call, step), "metering its step")
        return max((peak for _, peak in results if peak is not None), default=None)

    def _meter(self, call: Call, step: PlannedStep) -> tuple[bool, int | None]:
        """(deferred, this rank's metered peak): deferred while a caller's profiler records (sessions do not nest)."""
        if profiler_active():
            return True, None
        return False, metered_step(self.resolver.module, step, call)


def _refuse_stepped_down_apart(gathered: list) -> None:
    """Raise on every rank (all decide alike, from the gathered data) when ranks see different shapes and one of
    them would run a first plan stepped down (NOTE [loss-only first plan]): that plan's backward checks the
    callers' use of the outputs with every rank, which needs every rank to run it."""
    for rank, (key, _, _, _, floors) in enumerate(gathered):
        if floors:
            raise RematError(
                f"remat_plugin: ranks see different input shapes ({', '.join(describe(k) for k, *_ in gathered)}), "
                f"and rank {rank}'s step for {describe(key)} is a first plan that keeps only the loss (NOTE "
                "[loss-only first plan]): its backward checks what every rank's caller did with the outputs, so "
                "every rank must run it. Give every rank batches of the same shapes (pad to fixed lengths), or "
                f"raise the budget to at least {human_bytes(floors[0])} so the first plan keeps every output")
