"""Rank agreement: with several processes, every rank runs the plan rank 0 made.

Every training call, ranks gather each other's signature key.  When all ranks already have a
step for their shapes, nothing more happens; when all need the same new plan, rank 0 makes
it with the smallest budget of all ranks and broadcasts it, and the others replay it (a
fallback plan too: every rank then checkpoints the same layers).  Whatever fails on rank 0
while it plans is sent to the other ranks and raised there, so no rank waits for a plan that
never comes.  Ranks that see different shapes plan their own (warned once).
"""
from __future__ import annotations

import logging

from remat_plugin.errors import RematError
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime import dist
from remat_plugin.runtime.resolver import BudgetFn, StepResolver
from remat_plugin.runtime.signature import Call
from remat_plugin.runtime.steps import PlannedStep

log = logging.getLogger(__name__)


class RankAgreement:
    """Agrees on steps across ranks for one :class:`StepResolver`; see the module docstring."""

    def __init__(self, resolver: StepResolver):
        self.resolver = resolver
        self._warned = False

    def step_for(self, call: Call, budget: BudgetFn) -> PlannedStep | None:
        """The step every rank runs for this call, or None when ranks see different shapes."""
        gathered = dist.all_gather((call.key, call.key in self.resolver.steps))
        if all(have for _, have in gathered):
            return self.resolver.steps[call.key]
        if len({key for key, _ in gathered}) == 1:
            return self._agreed_step(call, budget)
        if not self._warned:
            log.warning("remat_plugin: ranks see different input shapes; each rank plans its own shapes")
            self._warned = True
        return None

    def _agreed_step(self, call: Call, budget: BudgetFn) -> PlannedStep:
        """All ranks need a step for the same shapes: rank 0 decides the plan, every rank runs it."""
        budget_bytes = min(dist.all_gather(budget()))
        step: PlannedStep | None = None
        payload: tuple[str, str] | None = None
        if dist.is_rank_zero():
            try:
                step = self.resolver.replay_known(call, budget_bytes)
                if step is not None:
                    plan = step.plan
                else:
                    plan, step = self.resolver.solve_bucket(call, budget_bytes)
                assert plan is not None
                payload = ("plan", plan.to_json())
            except Exception as exc:  # any failure (out of memory too) must reach the ranks waiting below
                dist.broadcast_from_rank_zero(("error", f"{type(exc).__name__}: {exc}"))
                raise
        kind, text = dist.broadcast_from_rank_zero(payload)
        if kind == "error":
            raise RematError(f"remat_plugin.session: rank 0 could not plan: {text}")
        plan = Plan.from_json(text)
        if not dist.is_rank_zero():
            self.resolver.adopt(plan.signature, plan)
        if step is None:
            step = self.resolver.replay(plan, call, budget_bytes)
        self.resolver.steps[call.key] = step
        return step
