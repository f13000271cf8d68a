"""Calibration: a new plan is metered at the allocator before a caller's step runs it, and corrected.

NOTE [calibration]
    Before the first call of a plan solved here runs, one forward+backward of it is metered at
    the allocator (:func:`metered_step`: the allocator's own events, on CPU and CUDA), unobserved:
    buffers, RNG and ``.grad`` are left as they were.  If it rose above the budget, or more than
    :data:`TOLERANCE` (and 64 KiB) above the prediction plus the corrections already made, the gap
    is added to the bytes the planner keeps back and the shapes are planned again, the new plan
    metered in turn, each correction logged as a warning.  A plan that measured within the budget is
    corrected at most :data:`MAX_CORRECTIONS` times per signature; one that measured over it is corrected
    up to :data:`MAX_OVER_BUDGET_CORRECTIONS` times, and after that the call raises
    :class:`~remat_plugin.errors.InfeasibleBudgetError` rather than run (compiled programs, whose fused
    kernels the op model does not see, use both corrections on bert-tiny).  So a model that misses
    memory costs extra metered steps, never a caller's step over budget.  If no plan fits with the
    correction, a plan that measured over the budget raises :class:`~remat_plugin.errors.InfeasibleBudgetError`;
    one that measured within it is kept.
    A prediction above the measurement is budget left unused, not a risk: it is not corrected.
    Metering runs with the caller's dispatch modes suspended, and waits while the caller's
    profiler runs (sessions do not nest).  With several ranks, each meters the plan rank 0 sent
    and the highest peak decides for all (:meth:`~remat_plugin.runtime.agreement.RankAgreement.calibrated`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from remat_plugin.capture.export import EAGER
from remat_plugin.capture.memory_meter import allocator_slack, allocator_trace, memory_profile, warm_backward_workspaces
from remat_plugin.capture.output_usage import loss_index, tensor_leaves
from remat_plugin.errors import InfeasibleBudgetError, RematError, human_bytes
from remat_plugin.ir.plan import MARGIN_MIN_BYTES, Plan
from remat_plugin.runtime import dist
from remat_plugin.runtime.side_effects import unobserved
from remat_plugin.runtime.signature import Call
from remat_plugin.runtime.steps import PlannedStep, written_inputs
from remat_plugin.torch_private import autocast_disabled, pytree, suspended_user_modes

log = logging.getLogger(__name__)

TOLERANCE = 0.05  # a metered peak this far above the prediction is corrected
MAX_CORRECTIONS = 2  # of plans that measured within the budget, above their prediction
MAX_OVER_BUDGET_CORRECTIONS = 4  # of plans that measured over it; then the call raises instead of running


def metered_step(module: nn.Module, step: PlannedStep, call: Call) -> int | None:
    """The allocator's peak rise over one forward+backward of ``step`` on ``call``, run unobserved; None when
    no output carries a gradient or the step could not be metered (a warning says why).

    It mirrors a caller's step: outputs the plan frees are dropped, the others held through the
    backward, which starts from the first scalar output (the loss; else the sum of the first
    differentiable output), so the other outputs' gradients are materialized as in the caller's
    step.  Gradients are returned by ``torch.autograd.grad``, not accumulated: ``.grad``, DDP's and
    optimizers' accumulation hooks are untouched.
    """
    assert step.plan is not None
    params = [p for p in module.parameters() if p.requires_grad]
    dropped = set(step.plan.dropped_outputs)

    # Inputs that need no gradient are passed as fresh aliases: hooks a caller's tool put on them (a module
    # tracker's backward hooks) are not ours to fire.
    args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t if t.requires_grad else t.detach(),
                                        (call.args, call.kwargs))

    def run() -> bool:
        outputs = tensor_leaves(step(args, kwargs))
        held = [t for i, t in enumerate(outputs) if i not in dropped]
        del outputs
        root = loss_index(held)
        if root is None or not params:
            return False
        loss = held[root] if held[root].numel() == 1 else held[root].sum()
        # where the step's backward was traced for: after the caller's autocast block, or inside it
        options = getattr(step.run, "options", EAGER)
        with contextlib.nullcontext() if options.backward_autocast else autocast_disabled():
            torch.autograd.grad(loss, params, allow_unused=True)
        return True

    warm_backward_workspaces(call.device)  # a one-time cuBLAS block is not the plan's
    try:
        # The allocator's own events on CPU and CUDA alike: unlike max_memory_allocated, reading them resets
        # none of the caller's peak statistics.
        with suspended_user_modes(), unobserved(module, call.device, written_inputs(step.run, call.args, call.kwargs)), \
                memory_profile(cuda=call.device.type == "cuda") as prof:
            ran = run()
        peak = allocator_trace(prof, call.device).peak_rise()[0]
    except RuntimeError as exc:  # a hook of the caller's may refuse autograd.grad: metering is ours, not the step
        if isinstance(exc, torch.OutOfMemoryError):
            raise
        if not getattr(step.run, "hooks_refused", False):  # a fallback torch.func refused says what it does instead
            log.warning("remat_plugin: calibration: the metered step of %s failed (%s: %s); its plan runs unmetered",
                        type(module).__name__, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        return None
    finally:
        step.take_usage()  # what this backward did with the outputs is ours, not the caller's (NOTE [output usage])
    return peak if ran else None


class Calibration:
    """The corrections made per signature key (NOTE [calibration])."""

    def __init__(self) -> None:
        self.corrections: dict[str, list[int]] = {}

    def bytes_for(self, call: Call) -> int:
        """Bytes the planner keeps back for this call's signature, on top of the safety margin: the corrections,
        and on CUDA the caching allocator's slack (NOTE [allocator slack] in capture/memory_meter.py)."""
        return sum(self.corrections.get(call.key, ())) + allocator_slack(call.device)

    def correct(self, call: Call, plan: Plan, measured: int) -> bool:
        """Whether ``measured`` (the plan's metered peak) calls for a new plan; the correction is then recorded.

        A correction is the measured gap: the next plan keeps it back, so that its peak as predicted
        plus the gap stays within the usable budget.
        """
        corrections = self.corrections.setdefault(call.key, [])
        expected = plan.predicted_peak_bytes + sum(corrections)
        gap = measured - expected
        where = (f"measured peak {human_bytes(measured)} against predicted {human_bytes(expected)} "
                 f"(budget {human_bytes(plan.budget_bytes)}) for {call.signature.describe()}")
        over = measured > plan.budget_bytes
        if not over and gap <= max(TOLERANCE * plan.predicted_peak_bytes, MARGIN_MIN_BYTES):
            log.debug("remat_plugin: calibration: %s", where)
            return False
        limit = MAX_OVER_BUDGET_CORRECTIONS if over else MAX_CORRECTIONS
        if len(corrections) >= limit:
            if over:  # never run a caller's step over the budget
                raise InfeasibleBudgetError(plan.budget_bytes, measured + plan.margin_bytes,
                                            what=f"step as metered after {len(corrections)} corrections ({where})")
            log.warning("remat_plugin: calibration: %s after %d corrections; not correcting again (within the "
                        "budget)", where, len(corrections))
            return False
        corrections.append(gap)
        log.warning("remat_plugin: calibration: %s; planning again with %s more kept back (correction %d of %d)",
                    where, human_bytes(gap), len(corrections), limit)
        return True

    def replanned(self, call: Call, plan: Plan, measured: int | None,
                  replan: Callable[[], PlannedStep]) -> PlannedStep | None:
        """The step ``replan()`` makes when ``measured`` (``plan``'s metered peak) calls for a correction, or None
        to keep ``plan``.  If no plan fits with the correction, a plan that measured over its budget raises; one
        within it is kept and the correction withdrawn."""
        if measured is None or not self.correct(call, plan, measured):
            return None
        try:
            return replan()
        except RematError as err:  # under several ranks, rank 0's InfeasibleBudgetError arrives as a RematError
            if not dist.failed_with(err, InfeasibleBudgetError) or measured > plan.budget_bytes:
                raise
        self.withdraw(call)
        log.warning("remat_plugin: calibration: no plan keeps that much back; keeping the plan, which "
                    "measured within the budget")
        return None

    def withdraw(self, call: Call) -> None:
        """Forget the latest correction: no plan keeps it back, and the plan it corrected measured within budget."""
        self.corrections[call.key].pop()
