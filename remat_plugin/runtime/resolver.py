"""Which step runs a call: the step built for exactly these shapes, else a known plan replayed, else a new plan.

In order, for a call with new input shapes:

1. a step already built for exactly these shapes runs;
2. else a known plan whose bucket covers the shapes (:meth:`Signature.covers`) is replayed:
   the graph is captured for these shapes and the plan's schedule re-checked by the
   simulator at these sizes -- no profiling, no solving;
3. else the bucket (sequence length rounded up) is planned, from the disk cache if it holds
   the plan, and the call's step replays that plan; when the bucket is the call's own shapes
   (or cannot be planned), the call's shapes are planned.

NOTE [output usage]
    A plan first assumes the caller keeps every output to the end of the step.  Each step
    watches what the caller did (:class:`~remat_plugin.capture.output_usage.OutputUsage`): when a
    freshly solved step's outputs were dropped before ``backward()`` and got no gradient (a
    training step keeps ``.loss``, drops the logits) and they are at least
    :data:`REFINE_MIN_SHARE` of the predicted peak, the next call of those shapes re-plans
    once with them freed after the forward.  An output counts as dropped when no tensor of the
    caller's refers to it as the backward begins and its storage is gone once the backward is over
    (a ``detach()``-ed copy the caller keeps holds it; ``_OutputWatch`` in
    :mod:`remat_plugin.capture.output_usage`).  A later step that holds or differentiates an output its
    plan frees is logged as a warning (that step ran with the output alive, over the plan by its
    size) and the next call re-plans with that output kept.  Outputs the caller holds
    through ``backward()`` that no gradient reaches (``out = model(...); out.loss.backward()``) are
    re-planned for the same way: their gradients are left out of the backward (NOTE [dropped
    tangents]), and a later step whose gradient does reach one adds it, is warned about, and re-plans.

    The steps also learn where ``backward()`` runs.  Eager autocast casts the backward's ops too when
    ``backward()`` is called inside the ``torch.autocast`` block (Lightning's manual optimization does
    so); steps are traced for a backward after the block (PyTorch's advice, Lightning's automatic
    optimization, Accelerate) until one is seen inside it: that step is warned about (its gradients
    may differ from eager's in rounding) and the steps are traced again for the other place.  Callers
    that know beforehand set it in the resolver's ``execution`` options.

NOTE [loss-only first plan]
    The first plan of a call cannot know yet what the caller does with the outputs, so it keeps
    them all to the end of the step, gradients included.  For a language model that costs the
    logits and their zero gradient: on GPT-2 small's shape at 8 x 1024 (50,257-token vocabulary) the
    first plan's floor was 0.62 of the unmodified peak, where per-layer checkpointing measured 0.39
    (an H200).  So when no plan fits, and the call returns one floating scalar (the loss) beside
    other tensors, it is planned again with the others held but given no gradient (``out =
    model(...); out.loss.backward()``), and if that does not fit either, with them freed after the
    forward (``loss = model(...).loss``).  The plan's backward refuses, before any gradient is
    computed, a use it cannot run within the budget: a gradient sent into one of the others, or,
    where the plan frees them, one of them still held (:class:`InfeasibleBudgetError`, naming the
    floor that use needs).  Such a step raises rather than run over the budget.  The floors are part
    of the plan (``Plan.loss_only_floors``): a plan loaded from disk, or sent by rank 0, refuses alike.
    Under several ranks rank 0 steps down, and each rank's backward gathers every rank's verdict
    before it runs, so a refusal on one rank raises on all of them in that backward; none is left
    waiting in the gradients' all-reduce.

NOTE [refined step-down]
    A first plan that stepped down to the others held without a gradient is planned again, once,
    when a step shows the caller drops every one of them before ``backward()`` (``loss =
    model(...).loss``, a Lightning ``training_step``, transformers' Trainer): with them freed after the
    forward, as NOTE [output usage] refines a plan that fits.  A gradient into them is still refused
    (the first floor).  Holding them is not: the budget fits a plan that holds them (the one before),
    so a later step that holds them is treated as NOTE [output usage] treats a refined plan's: that step
    runs with them alive, over its plan by their size, is warned about, and the next call plans them
    held without a gradient again (still refusing a gradient), not refined again.  Before, such a plan
    kept outputs it never held: on an H200, GPT-2 small's shape at 8 x 1024 at half its unmodified
    peak kept back one logits tensor (1.53 GiB; predicted 6.30 GiB, measured 4.77) and ran at 1.47x.
    On the CPU, gpt2-tiny's shape with a 16,000-token vocabulary (4 x 256, float32, 0.88 of the first
    plan's floor): the held plan predicted 1.11x, the freed one 1.01x, and its steps took 0.92 of the
    held plan's (median of 21 interleaved pairs, ad hoc, 2026-11-28).

NOTE [many shapes]
    A step is built per exact input shape: a plan made for a bucket is replayed on shorter inputs
    without profiling or solving, but each new shape still captures the model's graph (export and
    trace, 1.2-1.3 s on gpt2-tiny here, one layer traced for all; NOTE [layers traced once]) before its
    first call, and its step stays cached in host memory.  Batches padded to whatever each holds
    (dynamic padding) meet a new length almost every step at first.  When a module has met
    :data:`MANY_SHAPES` signatures, the caller is told once, with the fix: pad to a few fixed lengths.

Calibration: NOTE [calibration] in :mod:`remat_plugin.runtime.calibration`.

:class:`~remat_plugin.runtime.module.RematModule` and
:class:`~remat_plugin.runtime.session.RematSession` both resolve their steps here.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from remat_plugin.capture.export import ExecutionOptions, graph_text
from remat_plugin.capture.module_attributes import not_read, say_changed
from remat_plugin.capture.output_usage import OutputUsage, in_flight, outputs_beside_the_loss
from remat_plugin.capture.segments import MAX_SEGMENTS
from remat_plugin.capture.switches import CaptureSwitch
from remat_plugin.errors import CallsInFlightError, CaptureError, InfeasibleBudgetError, RematError, human_bytes
from remat_plugin.ir.plan import Plan, budget_for_peak
from remat_plugin.runtime import dist
from remat_plugin.runtime.calibration import Calibration, metered_step
from remat_plugin.runtime.fallback import CheckpointedRun, size_fallback
from remat_plugin.runtime.progress import PlanningProgress
from remat_plugin.runtime.reporting import announce, summary_line
from remat_plugin.runtime.signature import BucketPolicy, Call, bucketed_inputs, describe, python_values
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
from remat_plugin.torch_private import profiler_active, user_modes_active

log = logging.getLogger(__name__)

BudgetFn = Callable[[], int]  # the budget in bytes, asked for only when a step must be made
REFINE_MIN_SHARE = 0.01  # dropped outputs smaller than this share of the predicted peak are not worth a re-plan
MANY_SHAPES = 16  # input signatures after which the caller is told each new one is captured again (NOTE [many shapes])
_planning_for_usage = CaptureSwitch()


def outputs_planned_as_first() -> contextlib.AbstractContextManager[None]:
    """Steps run inside keep their first plan's outputs: each kept to the step's end with its gradient (the package
    before NOTE [output usage]; a benchmark's baseline).  A caller's use a plan cannot run is still re-planned for."""
    return _planning_for_usage.off()


class StepTable(dict[str, PlannedStep]):
    """Steps by exact signature key; tells the caller once when many signatures have each needed a step of their
    own (NOTE [many shapes]), and once per argument when a Python value changed between calls (NOTE [Python values
    in a call])."""

    def __init__(self, model: str):
        super().__init__()
        self.model = model
        self.seen: set[str] = set()  # every key a step was built for, steps dropped or rebuilt since included
        self.constants: dict[tuple, dict[str, str]] = {}  # the tensors' description -> the Python values met first
        self.told_constants: set[str] = set()

    def note_constants(self, call: Call) -> None:
        """NOTE [Python values in a call]
            Values other than tensors in a call (a Python int or float, a string) are constants of the traced
            graph and part of the signature, so a call that changes one, its tensors alike, captures and plans
            again (seconds).  A loop passing a changing number (a token count, a step, a schedule's value) does
            so at every step; the caller is told at the second value, naming the argument and the fix.
        """
        values = python_values(call.args, call.kwargs)
        if not values:
            return
        tensors = (call.signature.layout, tuple(x for x in call.signature.leaves if not isinstance(x, str)),
                   call.signature.training, call.signature.state)
        first = self.constants.setdefault(tensors, values)
        changed = [name for name, value in values.items() if first.get(name) != value and name not in
                   self.told_constants]
        if changed:
            self.told_constants.update(changed)
            name = changed[0]
            log.warning(
                "remat_plugin: %s was called with another value of the Python argument %s (%s, first %s). Values "
                "other than tensors are constants of the traced graph, so each new one captures and plans the step "
                "again (seconds). Pass it as a tensor (torch.tensor(...)), or keep it the same in every call",
                self.model, name, values[name][:60], first.get(name, "absent")[:60])

    def __setitem__(self, key: str, step: PlannedStep) -> None:
        if key not in self.seen:
            self.seen.add(key)
            if len(self.seen) == MANY_SHAPES:
                log.warning(
                    "remat_plugin: %s has now been called with %d different input shapes (the latest: %s). Each new "
                    "shape captures the model's graph again before its first step (seconds each, more for deeper "
                    "models) and keeps its step in host memory; a shorter input replays its bucket's plan but is "
                    "still captured. Pad batches to a few fixed lengths: a multiple (transformers' "
                    "DataCollatorWithPadding(tokenizer, pad_to_multiple_of=64)) or one length (padding='max_length')",
                    self.model, MANY_SHAPES, describe(key))
        super().__setitem__(key, step)


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
                 on_new_plan: Callable[[Plan], None] | None = None, compile: bool = False,
                 backward_segments: int = MAX_SEGMENTS, trace_layers_once: bool = True):
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
        self.steps = StepTable(type(module).__name__)  # exact signature key -> step
        # Keys whose step was dropped for a changed Python value: the dropped graph's code and the values changed,
        # to tell, once built again, whether the forward reads them (NOTE [module attributes]).
        self._retraced: dict[str, tuple[str, list[tuple[str, Any, Any]]]] = {}
        self.latest: PlannedStep | None = None  # the step of the latest call
        self.latest_added: Plan | None = None  # the plan added to the store last
        self.n_solved = 0  # plans solved here (not replayed, loaded or received)
        self.n_replayed = 0  # steps built from a known plan
        self.n_refined = 0  # plans solved again with the outputs the caller drops freed (NOTE [output usage])
        self._refined: set[str] = set()  # signature keys re-planned for their output usage
        self._unplannable_buckets: set[str] = set()  # bucket keys whose padded inputs the model refused
        self.calibration = Calibration()
        # Under several ranks a first plan steps down only when every rank will run it (NOTE [loss-only first plan]):
        # while rank 0 plans for all of them (planning_for_every_rank), never for a rank planning its own shapes.
        self._for_every_rank = False
        self.execution = ExecutionOptions(compile=compile, backward_segments=backward_segments,
                                          layers_once=trace_layers_once)  # backward_autocast: learned (NOTE [output usage])

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

    @contextlib.contextmanager
    def planning_for_every_rank(self):
        """Inside, the plans made here are run by every rank (rank 0 planning for the rest): a first plan may step
        down (NOTE [loss-only first plan])."""
        was, self._for_every_rank = self._for_every_rank, True
        try:
            yield
        finally:
            self._for_every_rank = was

    def _may_step_down(self) -> bool:
        return dist.world_size() == 1 or self._for_every_rank

    # --- resolution ------------------------------------------------------------------------
    def step_for(self, call: Call, budget: BudgetFn) -> PlannedStep:
        step = self.known_step(call)
        if step is None:
            self.steps.note_constants(call)
            step = self.steps[call.key] = self.new_step(call, budget())
        return step

    def known_step(self, call: Call) -> PlannedStep | None:
        """The step built for exactly this call: its shapes, and the module's parameter and buffer tensors.

        A step whose tensors were replaced since (``tie_weights``, a new ``nn.Parameter``), or whose
        modules' Python values changed (NOTE [module attributes]), is dropped: it would run the old
        ones.  Its plan stays in the store and is replayed.
        """
        step = self.steps.get(call.key)
        if step is not None and step.tensor_ids != call.tensor_ids:
            log.info("remat_plugin: parameters or buffers of %s were replaced since its step for %s was built; "
                     "rebuilding the step", type(self.module).__name__, call.signature.describe())
            del self.steps[call.key]
            return None
        if step is None:
            return None
        traced_before = self._retraced.pop(call.key, None)
        exported = step.exported_module()
        if traced_before is not None and exported is not None and graph_text(exported) == traced_before[0]:
            not_read(self.module, traced_before[1])  # the same graph: the forward does not read them
        changed = step.changed_values()
        if changed:  # NOTE [module attributes]
            say_changed(self.module, changed)
            if exported is not None:
                self._retraced[call.key] = (graph_text(exported), changed)
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
            if plan.loss_only_floors and not self._may_step_down():
                continue
            return self.replay(plan, call, budget_bytes)
        return None

    def replay(self, plan: Plan, call: Call, budget_bytes: int) -> PlannedStep:
        """A step running ``plan`` on this call: its schedule, or per-layer checkpointing for a fallback plan."""
        if plan.fallback:
            return fallback_step(self.module, call, plan)
        step = replay_step(self.module, call, plan, budget_bytes, self.execution)
        _refuse_other_uses(step, plan, type(self.module).__name__)
        self.n_replayed += 1
        return step

    def solve_bucket(self, call: Call, budget_bytes: int) -> tuple[Plan, PlannedStep | None]:
        """Plan the bucket of this call; returns the plan, and the step when the bucket is the call's shapes."""
        b_args, b_kwargs, changed = bucketed_inputs(call.args, call.kwargs, self.seq_bucket)
        bucket = Call.of(self.module, b_args, b_kwargs) if changed else call
        stored = self.store.load_from_disk(bucket.key)
        if stored is not None and stored.predicted_peak_bytes <= budget_bytes and \
                (not stored.loss_only_floors or self._may_step_down()):
            self.adopt(bucket.key, stored)
            if self.verbose:
                self.report(summary_line(stored, type(self.module).__name__, loaded_from=self.store.cache_dir))
            return stored, None
        if changed and bucket.key not in self._unplannable_buckets:
            try:
                solved = self.solve(bucket, budget_bytes, now=True)
                assert solved.plan is not None
                self._meter_fallback(bucket, solved)  # a fallback: metered once at the bucket's shapes, for its calls
                assert solved.plan is not None
                return solved.plan, None
            except Exception as exc:  # the model may refuse the padded inputs in any way
                if isinstance(exc, RematError) and not isinstance(exc, (CaptureError, InfeasibleBudgetError)):
                    raise
                # The padding is zeros: a vision-language model finds no image tokens in them and raises, a tensor
                # of image sizes padded as if it were a sequence breaks its reader. Each shape is planned as it is.
                self._unplannable_buckets.add(bucket.key)
                log.info("remat_plugin: bucket %s could not be planned (%s: %s); planning the exact shapes",
                         bucket.key[:120], type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        step = self.solve(call, budget_bytes)
        return step.plan, step  # type: ignore[return-value]  # None only while a lazy plan awaits its call

    def solve(self, call: Call, budget_bytes: int, now: bool | None = None, *,
              dropped_outputs: frozenset[int] = frozenset(), ungraded_outputs: frozenset[int] = frozenset(),
              refine: bool = False, loss_only_floors: tuple[int, ...] = ()) -> PlannedStep:
        """Capture, profile and solve for this call; with ``now`` (default: not ``plan_lazily``) before returning.

        ``dropped_outputs``/``ungraded_outputs``/``refine``: a re-plan for the outputs the caller drops or takes
        no gradient of (NOTE [output usage]).  ``loss_only_floors``: the plan is a first plan stepped down (NOTE
        [loss-only first plan]); a re-plan of such a plan for the same outputs (a calibration) stays one.
        """
        now = not self.plan_lazily if now is None else now
        model = type(self.module).__name__
        previous = self.steps.get(call.key)  # a step of this very call (a re-plan): its export is traced again
        exported = previous.exported_module() if previous is not None and previous.tensor_ids == call.tensor_ids \
            else None
        before = previous.plan if previous is not None else None
        if not loss_only_floors and before is not None and before.loss_only_floors:
            loss_only_floors = _floors_kept(before, dropped_outputs, ungraded_outputs)
        progress = PlanningProgress(f"planning {model}") if self.verbose else None

        def on_plan(step: PlannedStep) -> None:
            assert step.plan is not None
            if loss_only_floors:
                step.plan = dataclasses.replace(step.plan, loss_only_floors=loss_only_floors)
                _refuse_other_uses(step, step.plan, model)
            self._add(call.key, step.plan, solved=not refine)
            self.n_refined += refine
            self.store.save_to_disk(call.key, step.plan)
            if progress is not None:
                progress.close()  # the line goes where the bar was
                self.report(summary_line(step.plan, model, elapsed_s=progress.elapsed_s))

        with progress if progress is not None and now else contextlib.nullcontext():
            step = plan_step(self.module, call, budget_bytes, ilp_time_limit_s=self.ilp_time_limit_s,
                             caches=self.caches, progress=progress, find_floor=self.find_floor, on_plan=on_plan,
                             dropped_outputs=dropped_outputs, ungraded_outputs=ungraded_outputs,
                             calibration_bytes=self.calibration.bytes_for(call),
                             options=self.execution, exported=exported,
                             on_fallback_in_call=functools.partial(self._size_in_call, call))
            step.to_meter = True
            if now and not step.checked:
                try:
                    run_unobserved(self.module, step, call)  # traces and plans; the outputs are dropped
                except InfeasibleBudgetError as exc:
                    if refine or dropped_outputs or ungraded_outputs:
                        raise
                    return self._loss_only_step(call, step, exc)
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
    def run(self, call: Call, step: PlannedStep, budget: BudgetFn, *, replan_on_mismatch: bool = True,
            refine: bool = True) -> Any:
        """Run ``step`` on ``call``; a replayed plan that does not fit this graph is replaced by a new plan.

        ``refine``: re-plan for what the caller did with the previous outputs (NOTE [output usage]).
        """
        if refine:
            step = self._refined_step(call, step, budget)
        self.latest = step
        try:
            return self._call(step, call, budget if refine else None)
        except PlanMismatch as exc:  # raised by a replayed step's first call, before anything ran
            if not replan_on_mismatch:
                raise RematError(f"remat_plugin.session: the plan agreed between ranks does not apply here: {exc}") \
                    from exc
            log.info("remat_plugin: plan does not replay on %s (%s); planning these shapes", call.key[:120], exc)
            step = self.steps[call.key] = self.solve(call, budget())
            self.latest = step
            return self._call(step, call, budget if refine else None)

    def _refuse_calls_in_flight(self, step: PlannedStep) -> None:
        """Raise before ``step`` runs beside earlier calls still awaiting backward, over its plan's budget (NOTE
        [calls in flight] in remat_plugin.capture.output_usage)."""
        plan, params = step.plan, getattr(step.run, "params", None)
        if plan is None or plan.fallback or not params:
            return
        calls, held = in_flight(params)
        if not calls or held + plan.predicted_peak_bytes <= plan.budget_bytes:
            return
        gc.collect()  # a graph held only by cyclic garbage (a caught exception's frames) is not in flight
        calls, held = in_flight(params)
        if calls and held + plan.predicted_peak_bytes > plan.budget_bytes:
            raise CallsInFlightError(type(self.module).__name__, calls, held, plan.predicted_peak_bytes,
                                     plan.budget_bytes, budget_for_peak(plan.baseline_peak_bytes))

    def _refined_step(self, call: Call, step: PlannedStep, budget: BudgetFn) -> PlannedStep:
        """``step``, or a new plan of its shapes when the previous call used its outputs otherwise than planned
        (NOTE [output usage])."""
        usage = step.take_usage()
        if step.plan is not None and step.plan.fallback:
            return self._fallback_for_usage(call, step, usage)
        if step.plan is None:
            return step
        if usage is not None and usage.backward_autocast != self.execution.backward_autocast:
            return self._rebuilt_for_backward_autocast(call, usage.backward_autocast, budget)
        outputs = None if usage is None else self.outputs_to_plan(call, step.plan, usage, step.problem is not None)
        if outputs is None:
            return step
        dropped, ungraded = outputs
        step = self.steps[call.key] = self.solve(call, budget(), dropped_outputs=dropped, ungraded_outputs=ungraded,
                                                 refine=True)
        return step

    def _fallback_for_usage(self, call: Call, step: PlannedStep, usage: OutputUsage | None) -> PlannedStep:
        """A metered fallback metered again for the outputs its caller frees before backward (once), or holds where
        the metering freed them (NOTE [metered fallback]); several ranks keep every output held."""
        plan = step.plan
        assert plan is not None
        if usage is None or plan.predicted_peak_bytes < 0 or dist.world_size() > 1:
            return step
        metered_without = frozenset(plan.dropped_outputs)
        dropped = usage.dropped
        now_held = metered_without - dropped
        if now_held:
            log.warning("remat_plugin: the step of %s held output(s) %s (%s) through backward, which its metering had "
                        "freed; this step may have exceeded the budget by up to that much. Metering it again with "
                        "them held", type(self.module).__name__, sorted(now_held),
                        human_bytes(sum(usage.output_bytes[i] for i in now_held)))
        elif dropped == metered_without or call.key in self._refined:
            return step
        self._refined.add(call.key)
        step.plan = dataclasses.replace(plan, dropped_outputs=tuple(sorted(dropped)))
        step.to_meter = True
        return step

    def _rebuilt_for_backward_autocast(self, call: Call, inside: bool, budget: BudgetFn) -> PlannedStep:
        """Steps traced for where the caller runs ``backward()``: inside or after its autocast block (the step
        that showed it has warned)."""
        log.info("remat_plugin: tracing the steps of %s again for backward() %s the autocast block",
                 type(self.module).__name__, "inside" if inside else "after")
        self.execution = dataclasses.replace(self.execution, backward_autocast=inside)
        self.steps.clear()  # the plans stay: a replay whose graph differs is planned again
        step = self.steps[call.key] = self.new_step(call, budget())
        return step

    def outputs_to_plan(self, call: Call, plan: Plan, usage: OutputUsage,
                        solved_here: bool) -> tuple[frozenset[int], frozenset[int]] | None:
        """The outputs a new plan should free after the forward and those it should give no gradient (held
        but ungraded), or None to keep ``plan`` (NOTE [output usage]).  ``solved_here``: the plan was solved
        for these shapes, not replayed.  Depends only on its arguments and the calls refined before, so
        ranks that see the same usage decide alike."""
        dropped, ungraded = frozenset(plan.dropped_outputs), frozenset(plan.ungraded_outputs)
        kept = dropped - usage.dropped
        graded = (dropped | ungraded) & usage.graded
        if kept or graded:
            model = type(self.module).__name__
            if kept:
                log.warning("remat_plugin: the caller kept or differentiated output(s) %s of %s, which its plan frees "
                            "after the forward (the caller had dropped them before); that step ran with them alive, "
                            "above the plan by their size. Planning these shapes with them kept", sorted(kept), model)
            if graded - kept:
                log.warning("remat_plugin: a gradient reached output(s) %s of %s, which its plan gives none (none "
                            "reached them before); that step added it, above the plan by their size. Planning these "
                            "shapes for their gradient", sorted(graded - kept), model)
            still_dropped = dropped & usage.dropped
            return still_dropped, (dropped | ungraded) - usage.graded - still_dropped
        if not solved_here or call.key in self._refined or not _planning_for_usage.on:
            return None
        if plan.loss_only_floors and ungraded and not dropped and ungraded <= usage.dropped:
            to_free, without_gradient = ungraded, frozenset[int]()  # NOTE [refined step-down]
        elif dropped or ungraded:
            return None
        else:
            to_free, without_gradient = usage.dropped, usage.ungraded
        saved = sum(usage.output_bytes[i] for i in to_free | without_gradient if i < len(usage.output_bytes))
        if saved < REFINE_MIN_SHARE * plan.predicted_peak_bytes:
            return None
        self._refined.add(call.key)
        log.info("remat_plugin: the caller drops output(s) %s and takes no gradient of output(s) %s (%s); planning "
                 "%s again with them freed after the forward and without their gradients", sorted(to_free),
                 sorted(to_free | without_gradient), human_bytes(saved), call.signature.describe())
        return to_free, without_gradient

    def _calibrated_step(self, call: Call, step: PlannedStep, budget: BudgetFn) -> PlannedStep:
        """``step`` once metered, or the plan its metering called for (NOTE [calibration]); a fallback step's
        layers checkpointed as metering chose (NOTE [metered fallback])."""
        self._meter_fallback(call, step)
        while step.to_meter and step.checked and step.problem is not None and not profiler_active():
            step.to_meter = False  # a caller's profiler defers metering to a later call: sessions do not nest
            plan, measured = step.plan, metered_step(self.module, step, call)
            assert plan is not None
            replanned = self.calibration.replanned(call, plan, measured, functools.partial(
                self._resolve_now, call, budget, frozenset(plan.dropped_outputs), frozenset(plan.ungraded_outputs)))
            if replanned is None:
                break
            step = self.steps[call.key] = replanned
        self.latest = step
        return step

    def _size_in_call(self, call: Call, step: PlannedStep) -> None:
        """A fallback made inside a call (its graph failed at the trace: ``nonzero``, a boolean mask) metered before
        that call runs it (NOTE [metered fallback]); under several ranks the agreement meters it on every rank."""
        if dist.world_size() == 1:
            self._meter_fallback(call, step)

    def _meter_fallback(self, call: Call, step: PlannedStep) -> None:
        """A fallback ``step`` waiting to be metered is metered here on ``call`` (NOTE [metered fallback]); a
        caller's profiler defers it to a later call (sessions do not nest)."""
        if step.to_meter and step.plan is not None and step.plan.fallback and not profiler_active():
            step.to_meter = False
            self.size_fallback(call, step, lambda: metered_step(self.module, step, call))

    def size_fallback(self, call: Call, step: PlannedStep, meter: Callable[[], int | None]) -> None:
        """Checkpoint as many of a fallback step's layers as ``meter()``'s peaks call for (NOTE [metered fallback]);
        the plan stored for these shapes becomes the sized one."""
        assert isinstance(step.run, CheckpointedRun) and step.plan is not None
        sized = size_fallback(type(self.module).__name__, step.run, step.plan, call, meter)
        if sized is None:
            return
        step.plan, said = sized
        if call.key in self.store.plans:
            self.store.add(call.key, step.plan)
        if self.verbose:
            self.report(said)

    def _resolve_now(self, call: Call, budget: BudgetFn, dropped: frozenset[int], ungraded: frozenset[int]) -> PlannedStep:
        """A new plan of these shapes, made before the call runs (a calibration correction)."""
        return self.solve(call, budget(), now=True, refine=True, dropped_outputs=dropped, ungraded_outputs=ungraded)

    def _call(self, step: PlannedStep, call: Call, budget: BudgetFn | None) -> Any:
        self._refuse_calls_in_flight(step)  # before anything of the call runs, on either of run()'s paths
        with self._planning.pop(call.key, contextlib.nullcontext()):
            if not step.checked and user_modes_active():
                run_unobserved(self.module, step, call)  # capture and planning outside the caller's modes
            if budget is not None:
                step = self._calibrated_step(call, step, budget)
            try:
                return step(call.args, call.kwargs)
            except InfeasibleBudgetError as exc:  # a lazy plan, made inside this call, found none
                if budget is None or step.checked or step.plan is not None:
                    raise
                step = self.steps[call.key] = self._loss_only_step(call, step, exc)
        self.latest = step = self._calibrated_step(call, step, budget)  # metered before its first call runs
        return step(call.args, call.kwargs)

    def _loss_only_step(self, call: Call, step: PlannedStep, exc: InfeasibleBudgetError) -> PlannedStep:
        """A first plan that gives the outputs other than the loss no gradient, or also frees them, when none fits
        with every output kept and differentiated (NOTE [loss-only first plan]); raises ``exc`` where that does
        not apply."""
        run = step.run
        others = outputs_beside_the_loss(len(getattr(run, "out_tensor_positions", ())),
                                         list(getattr(run, "out_scalars", ())))
        if others is None or not self._may_step_down():
            raise exc
        floors = [exc.min_feasible_bytes]  # with the others differentiated, then held without a gradient
        for freed, use in ((False, "given no gradient"), (True, "freed after the forward")):
            log.info("remat_plugin: no plan of %s fits %s (smallest %s); planning it again with output(s) %s %s",
                     call.signature.describe(), human_bytes(exc.budget_bytes), human_bytes(floors[-1]),
                     sorted(others), use)
            try:
                return self.solve(call, exc.budget_bytes, now=True, dropped_outputs=others if freed else frozenset(),
                                  ungraded_outputs=frozenset() if freed else others, loss_only_floors=tuple(floors))
            except InfeasibleBudgetError as lower:
                floors.append(lower.min_feasible_bytes)
        raise InfeasibleBudgetError(
            exc.budget_bytes, floors[-1], what="forward+backward with only the loss kept",
            advice=f"Raise the budget to at least that ({human_bytes(floors[1])} for a step that holds the other "
                   f"outputs through backward(), {human_bytes(floors[0])} for one that differentiates them), or "
                   "reduce the batch size.") from None


def _floors_kept(before: Plan, dropped: frozenset[int], ungraded: frozenset[int]) -> tuple[int, ...]:
    """The floors a re-plan of ``before``, a first plan stepped down, refuses other uses by (NOTE [loss-only first
    plan]): for the same outputs (a calibration) its floors; for the same outputs freed where they were held, or
    held where it freed them for a caller that dropped them (NOTE [refined step-down]), only the first, which
    refuses a gradient into them."""
    if (before.dropped_outputs, before.ungraded_outputs) == (tuple(sorted(dropped)), tuple(sorted(ungraded))):
        return before.loss_only_floors
    if {*before.dropped_outputs, *before.ungraded_outputs} == dropped | ungraded:
        return before.loss_only_floors[:1]
    return ()


def _refuse_other_uses(step: PlannedStep, plan: Plan, model: str) -> None:
    """Make ``step``'s backward refuse a caller that uses the outputs other than the loss more than ``plan``, a
    first plan stepped down, allows (NOTE [loss-only first plan]).  With several ranks every rank's backward asks
    the others, so a refusal on one stops all of them there, none left waiting in the gradients' all-reduce."""
    floors = plan.loss_only_floors
    if not floors or not hasattr(step.run, "refuse_usage"):
        return
    others = frozenset(plan.dropped_outputs) | frozenset(plan.ungraded_outputs)
    freed = plan.refuses_holding  # a refined plan's caller who holds them is planned for (NOTE [output usage])

    def check(usage: OutputUsage) -> None:
        graded = sorted(others & usage.graded)
        held = sorted(others & usage.held) if freed else []
        if graded or held:
            what = (f"step of {model} that sends a gradient into output(s) {graded}" if graded else
                    f"step of {model} that keeps output(s) {held} through backward() (a detach()-ed copy keeps them "
                    "too: Lightning holds the tensors a training_step returns until on_train_batch_end)")
            raise InfeasibleBudgetError(
                plan.budget_bytes, floors[0] if graded else floors[1], what=what,
                advice="Keep only the loss (`loss = model(...).loss`, the other outputs dropped before "
                       "backward(); a training_step returns the loss alone), or raise the budget to at least that. "
                       "This backward was refused before it ran.")

    def refuse(usage: OutputUsage) -> None:  # in one process: check(usage) itself, with no collective
        dist.on_every_rank(lambda: check(usage), "checking, as backward() began, what its caller did with the outputs")

    step.run.refuse_usage = refuse  # type: ignore[attr-defined]
