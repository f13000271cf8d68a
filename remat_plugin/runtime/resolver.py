"""Which step runs a call: the step built for exactly these shapes, else a known plan replayed, else a new plan.

In order, for a call with new input shapes:

1. a step already built for exactly these shapes runs;
2. else a known plan whose bucket covers the shapes (:meth:`Signature.covers`) is replayed:
   the graph is captured for these shapes and the plan's schedule re-checked by the
   simulator at these sizes -- no profiling, no solving;
3. else the bucket (sequence length rounded up) is planned, from the disk cache if it holds
   the plan, and the call's step replays that plan; when the bucket is the call's own shapes
   (or cannot be planned), the call's shapes are planned.

:class:`~remat_plugin.runtime.module.RematModule` and
:class:`~remat_plugin.runtime.session.RematSession` both resolve their steps here.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from remat_plugin.errors import CaptureError, InfeasibleBudgetError, RematError
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.progress import PlanningProgress
from remat_plugin.runtime.reporting import announce, summary_line
from remat_plugin.runtime.signature import BucketPolicy, Call, bucketed_inputs
from remat_plugin.runtime.steps import (
    PlanMismatch,
    PlannedStep,
    PlanningCaches,
    fallback_step,
    plan_step,
    replay_step,
    run_unobserved,
)
from remat_plugin.runtime.store import PlanStore
from remat_plugin.torch_private import user_modes_active

log = logging.getLogger(__name__)

BudgetFn = Callable[[], int]  # the budget in bytes, asked for only when a step must be made


class StepResolver:
    """Steps by exact signature key, made from the plans in ``store``; see the module docstring.

    Args:
        seq_bucket: how sequence lengths round up into plan buckets (None: exact shapes).
        find_floor: compute the smallest feasible budget even when the unmodified step fits.
        plan_lazily: a new plan is made inside the call that needs it (no extra forward);
            otherwise it is made before the call runs, by one unobserved forward.
        verbose: planning shows a progress bar on a terminal, and each plan made or loaded here is told to
            ``report`` as one line (:func:`~remat_plugin.runtime.reporting.summary_line`).
        on_new_plan: told of every plan added to the store (solved, loaded or received).
    """

    def __init__(self, module: nn.Module, store: PlanStore, caches: PlanningCaches, *, ilp_time_limit_s: float,
                 seq_bucket: BucketPolicy = None, find_floor: bool = False, plan_lazily: bool = False,
                 verbose: bool = False, report: Callable[[str], None] = announce,
                 on_new_plan: Callable[[Plan], None] | None = None):
        self.module = module
        self.store = store
        self.caches = caches
        self.ilp_time_limit_s = ilp_time_limit_s
        self.seq_bucket = seq_bucket
        self.find_floor = find_floor
        self.plan_lazily = plan_lazily
        self.verbose = verbose
        self.report = report
        self._planning: dict[str, PlanningProgress] = {}  # progress of lazy plans, entered by the call that plans
        self.on_new_plan = on_new_plan
        self.steps: dict[str, PlannedStep] = {}  # exact signature key -> step
        self.latest: PlannedStep | None = None  # the step of the latest call
        self.latest_added: Plan | None = None  # the plan added to the store last
        self.n_solved = 0  # plans solved here (not replayed, loaded or received)
        self.n_replayed = 0  # steps built from a known plan

    @property
    def current_plan(self) -> Plan | None:
        """The plan of the latest call (or, before its step ran, the plan made for it)."""
        if self.latest is not None and self.latest.plan is not None:
            return self.latest.plan
        return self.latest_added

    def clear(self) -> None:
        """Forget every step and plan (the module moved to another device or dtype)."""
        self.steps.clear()
        self.store.plans.clear()
        self.latest = None
        self.latest_added = None

    # --- resolution ------------------------------------------------------------------------
    def step_for(self, call: Call, budget: BudgetFn) -> PlannedStep:
        step = self.known_step(call)
        if step is None:
            step = self.steps[call.key] = self.new_step(call, budget())
        return step

    def known_step(self, call: Call) -> PlannedStep | None:
        """The step built for exactly this call: its shapes, and the module's parameter and buffer tensors.

        A step whose tensors were replaced since (``tie_weights``, a new ``nn.Parameter``) is
        dropped: it would run the old ones.  Its plan stays in the store and is replayed.
        """
        step = self.steps.get(call.key)
        if step is not None and step.tensor_ids != call.tensor_ids:
            log.info("remat_plugin: parameters or buffers of %s were replaced since its step for %s was built; "
                     "rebuilding the step", type(self.module).__name__, call.signature.describe())
            del self.steps[call.key]
            return None
        return step

    def new_step(self, call: Call, budget_bytes: int) -> PlannedStep:
        step = self.replay_known(call, budget_bytes)
        if step is not None:
            return step
        plan, step = self.solve_bucket(call, budget_bytes)
        return step if step is not None else self.replay(plan, call, budget_bytes)

    def replay_known(self, call: Call, budget_bytes: int) -> PlannedStep | None:
        """Step 2 of the module docstring: the tightest known plan that covers this call."""
        for plan in self.store.covering(call.signature, budget_bytes):
            return self.replay(plan, call, budget_bytes)
        return None

    def replay(self, plan: Plan, call: Call, budget_bytes: int) -> PlannedStep:
        """A step running ``plan`` on this call: its schedule, or per-layer checkpointing for a fallback plan."""
        if plan.fallback:
            return fallback_step(self.module, call, plan)
        step = replay_step(self.module, call, plan, budget_bytes)
        self.n_replayed += 1
        return step

    def solve_bucket(self, call: Call, budget_bytes: int) -> tuple[Plan, PlannedStep | None]:
        """Plan the bucket of this call; returns the plan, and the step when the bucket is the call's shapes."""
        b_args, b_kwargs, changed = bucketed_inputs(call.args, call.kwargs, self.seq_bucket)
        bucket = Call.of(self.module, b_args, b_kwargs) if changed else call
        stored = self.store.load_from_disk(bucket.key)
        if stored is not None and stored.predicted_peak_bytes <= budget_bytes:
            self.adopt(bucket.key, stored)
            if self.verbose:
                self.report(summary_line(stored, type(self.module).__name__, loaded_from=self.store.cache_dir))
            return stored, None
        if changed:
            try:
                solved = self.solve(bucket, budget_bytes, now=True)
                assert solved.plan is not None
                return solved.plan, None
            except (CaptureError, InfeasibleBudgetError, RuntimeError) as exc:
                log.info("remat_plugin: bucket %s could not be planned (%s); planning the exact shapes",
                         bucket.key[:120], str(exc).splitlines()[0][:200])
        step = self.solve(call, budget_bytes)
        return step.plan, step  # type: ignore[return-value]  # None only while a lazy plan awaits its call

    def solve(self, call: Call, budget_bytes: int, now: bool | None = None) -> PlannedStep:
        """Capture, profile and solve for this call; with ``now`` (default: not ``plan_lazily``) before returning."""
        now = not self.plan_lazily if now is None else now
        model = type(self.module).__name__
        progress = PlanningProgress(f"planning {model}") if self.verbose else None

        def on_plan(step: PlannedStep) -> None:
            assert step.plan is not None
            self._add(call.key, step.plan, solved=True)
            self.store.save_to_disk(call.key, step.plan)
            if progress is not None:
                progress.close()  # the line goes where the bar was
                self.report(summary_line(step.plan, model, elapsed_s=progress.elapsed_s))

        with progress if progress is not None and now else contextlib.nullcontext():
            step = plan_step(self.module, call, budget_bytes, ilp_time_limit_s=self.ilp_time_limit_s,
                             caches=self.caches, progress=progress, find_floor=self.find_floor, on_plan=on_plan)
            if now and not step.checked:
                run_unobserved(self.module, step, call)  # traces and plans; the outputs are dropped
        if progress is not None and not now and not step.checked:
            self._planning[call.key] = progress  # a lazy plan is made by the step's first call: run() shows it
        return step

    def adopt(self, key: str, plan: Plan) -> None:
        """Add a plan made elsewhere (the disk cache, rank 0)."""
        self._add(key, plan, solved=False)

    def _add(self, key: str, plan: Plan, solved: bool) -> None:
        self.store.add(key, plan)
        self.latest_added = plan
        self.n_solved += solved
        if self.on_new_plan is not None:
            self.on_new_plan(plan)

    # --- running ---------------------------------------------------------------------------
    def run(self, call: Call, step: PlannedStep, budget: BudgetFn, *, replan_on_mismatch: bool = True) -> Any:
        """Run ``step`` on ``call``; a replayed plan that does not fit this graph is replaced by a new plan."""
        self.latest = step
        try:
            return self._call(step, call)
        except PlanMismatch as exc:  # raised by a replayed step's first call, before anything ran
            if not replan_on_mismatch:
                raise RematError(f"remat_plugin.session: the plan agreed between ranks does not apply here: {exc}") \
                    from exc
            log.info("remat_plugin: plan does not replay on %s (%s); planning these shapes", call.key[:120], exc)
            step = self.steps[call.key] = self.solve(call, budget())
            self.latest = step
            return self._call(step, call)

    def _call(self, step: PlannedStep, call: Call) -> Any:
        with self._planning.pop(call.key, contextlib.nullcontext()):
            if not step.checked and user_modes_active():
                run_unobserved(self.module, step, call)  # capture and planning outside the caller's modes
            return step(call.args, call.kwargs)
