"""Module-level fallback for models torch.export cannot capture.

When the whole model has no graph (data-dependent control flow, an unsupported op), we
still know its structure: its lists of repeated layers (a ``ModuleList`` or ``Sequential`` of one
class; a vision tower's beside a language model's) are the chains.  A layer may run under non-reentrant
``torch.utils.checkpoint``, which keeps only its inputs and recomputes the rest in
backward (random ops replay their generator state).  Buffers a layer updates in its
forward (BatchNorm running statistics) are restored after the recomputation, so they
change exactly once per step.

NOTE [metered fallback]
    Without a graph there is no memory model, so how many layers to checkpoint is measured: before the
    step's first call (as NOTE [calibration] meters a plan) one forward+backward with no layer checkpointed
    is metered at the allocator, unobserved.  Within the budget's usable part, nothing is checkpointed (no
    recomputation for nothing).  Else one with every layer checkpointed is metered: above the budget,
    :class:`~remat_plugin.errors.InfeasibleBudgetError` names the measured peak before the caller's step runs;
    within it, ``k`` layers are checkpointed, ``k`` read off the line between the two peaks, and metered in
    turn (up to :data:`MAX_SIZINGS` times, then all layers).  The plan records what was chosen
    (``blocks``: "checkpoint" or "keep" per layer) and the peaks measured.  The layers saving the most for
    backward (counted in the first metered step) are checkpointed first: a vision tower's before a language
    model's layers run on fewer tokens.  The metered steps hold every output through backward, as a caller
    that keeps them does; the step watches, as each backward begins, which outputs the caller still holds (by
    weak reference), and in one process a caller that freed some (``loss = model(...).loss`` frees the logits)
    has the step metered again without them, once; one that later holds an output the metering freed is warned
    (that step may have gone over by its size) and the step is metered again with it held.  A step that
    cannot be metered (no output carries a gradient), or a
    model with hooks (NOTE [module hooks]), which a metered step would run again, checkpoints every layer,
    unverified, as a warning says.  Layers run under a torch.func transform (an input Jacobian taken with
    ``jacrev`` in the forward) cannot be checkpointed: torch.func refuses the saved-tensor hooks checkpointing (and
    the saved-bytes count) needs.  That refusal is caught at the first metered step, which is metered again as
    written: the step runs unmodified within the budget, else :class:`~remat_plugin.errors.InfeasibleBudgetError`
    names that peak; a step that was not metered raises the refusal with its reason.  The metered steps run the
    forward's Python: side effects outside buffers and
    the random streams (a counter kept in a plain attribute) happen once more per metered step.  Under autocast
    each metered step starts and ends with autocast's cast cache cleared: the first one's casts of the weights,
    cached for the rest of the caller's autocast block, made the later ones (and the caller's step) look 10%
    lighter than they are (ELECTRA under bf16 autocast: 0.29 MiB metered, 0.33 MiB measured).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat_plugin.capture.forward_swap import swapped_forwards
from remat_plugin.capture.memory_meter import allocator_slack
from remat_plugin.capture.module_hooks import user_hooks
from remat_plugin.capture.output_usage import OutputUsage, loss_index, tensor_leaves, when_backward_starts
from remat_plugin.errors import CaptureError, InfeasibleBudgetError, human_bytes
from remat_plugin.ir.plan import BlockChoice, Plan, budget_for_peak, safety_margin
from remat_plugin.runtime.side_effects import restored_buffers
from remat_plugin.runtime.signature import Call
from remat_plugin.torch_private import in_backward

log = logging.getLogger(__name__)

MAX_SIZINGS = 3  # metered steps choosing how many layers a fallback checkpoints, past the first two
_SAVED_TENSOR_HOOKS_REFUSED = "support saved tensor hooks"  # torch.func's error inside checkpointing or our count


def _checkpointed_forward(layer: nn.Module, forward):
    def run(*args, **kwargs):
        if not in_backward():  # the forward pass: buffers update as usual
            return forward(*args, **kwargs)
        with restored_buffers(layer):  # a recomputation inside backward must not update buffers again
            return forward(*args, **kwargs)

    def checkpointed(*args, **kwargs):
        if not (torch.is_grad_enabled() and layer.training):
            return forward(*args, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return checkpointed


def checkpointed_layers(layers: list[nn.Module]) -> contextlib.AbstractContextManager[None]:
    """Run ``layers`` checkpointed inside the block; their ``forward`` is restored on exit."""
    return swapped_forwards(layers, _checkpointed_forward)


class CheckpointedRun:
    """The module's own forward with ``count`` of ``layers`` checkpointed, those that save the most for backward
    first (all of them until the step is metered: NOTE [metered fallback])."""

    def __init__(self, module: nn.Module, layers: list[nn.Module]):
        self.module, self.layers, self.count = module, layers, len(layers)
        self.order = list(range(len(layers)))  # the layers to checkpoint first, first
        self.usage: OutputUsage | None = None  # what the caller held as the latest call's backward began
        self.hooks_refused = False  # a call raised torch.func's refusal of saved-tensor hooks
        self._saved: list[int] | None = None  # while recording: bytes each layer's forward saves for backward

    @property
    def checkpointed(self) -> frozenset[int]:
        return frozenset(self.order[:self.count])

    def __call__(self, args: tuple, kwargs: dict):
        chosen = self.checkpointed
        layers = [layer for i, layer in enumerate(self.layers) if i in chosen]
        try:
            with checkpointed_layers(layers), self._recording():
                output = self.module(*args, **kwargs)
        except RuntimeError as exc:  # NOTE [metered fallback]: torch.func refuses the saved-tensor hooks
            if _SAVED_TENSOR_HOOKS_REFUSED not in str(exc):
                raise
            self.hooks_refused = True
            raise CaptureError(
                f"remat_plugin: {type(self.module).__name__}'s forward runs its layers under a torch.func transform "
                f"(jacrev, vmap, grad), which refuses the saved-tensor hooks checkpointing needs ({exc}): none of "
                "its layers can be recomputed. Train it with a budget above its unmodified peak, or unplanned "
                "(rm.original)", fallback=False) from exc
        if torch.is_grad_enabled():
            self._watch(output)
        return output

    def _watch(self, output: Any) -> None:
        """As the backward of the loss (the first scalar output with a gradient) begins, :attr:`usage` records
        which outputs the caller still holds, by weak reference (NOTE [metered fallback]); read with
        :meth:`~remat_plugin.runtime.steps.PlannedStep.take_usage`."""
        leaves = tensor_leaves(output)
        root = loss_index(leaves, scalar_only=True)
        if root is None:
            return

        def seen(held: frozenset[int], sizes: tuple[int, ...]) -> None:
            self.usage = OutputUsage(len(sizes), held | {root}, frozenset({root}), output_bytes=sizes)

        when_backward_starts(leaves, root, seen)

    @contextlib.contextmanager
    def ordered_by_saved_bytes(self) -> Iterator[None]:
        """Inside, a run with no layer checkpointed counts what each layer's forward saves for backward
        (activations, not parameters); on exit :attr:`order` puts the layers saving the most first."""
        self._saved = [0] * len(self.layers)
        try:
            yield
            saved = self._saved
            self.order = sorted(range(len(self.layers)), key=lambda i: -saved[i])
        finally:
            self._saved = None

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        saved = self._saved
        if saved is None or self.count:
            yield
            return
        current: list[int] = []
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not current or isinstance(t, nn.Parameter) or t.device.type == "meta":
                return t
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor with no storage of its own (sparse, a subclass)
                return t
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                saved[current[-1]] += storage.nbytes()
            return t

        def enter(index: int):
            def hook(module: nn.Module, args: tuple) -> None:
                current.append(index)
            return hook

        def leave(module: nn.Module, args: tuple, out) -> None:  # a hook returning a value replaces the output
            current.pop()

        hooks = [h for i, layer in enumerate(self.layers)
                 for h in (layer.register_forward_pre_hook(enter(i)), layer.register_forward_hook(leave))]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in hooks:
                h.remove()


def fallback_plan(reason: str, chains: list[tuple[str, list[nn.Module]]], budget_bytes: int, signature: str) -> Plan:
    """A plan that records the fallback; memory figures are unknown (-1) without a graph."""
    names = " and ".join(repr(name) for name, _ in chains)
    n_layers = sum(len(layers) for _, layers in chains)
    log.warning(
        "remat_plugin: %s; falling back to checkpointing the %d layers of %s. Without a graph there is no "
        "memory model: a metered step before the first call chooses how many are checkpointed under the budget of "
        "%d bytes.", reason, n_layers, names, budget_bytes,
    )
    return Plan(
        budget_bytes=budget_bytes, margin_bytes=0, predicted_peak_bytes=-1, predicted_time_ms=-1.0,
        baseline_peak_bytes=-1, baseline_time_ms=-1.0, min_feasible_bytes=-1,
        blocks=tuple(BlockChoice(i, 0, "checkpoint", -1, -1.0) for i in range(n_layers)),
        n_unique_blocks=1, signature=signature,
        fallback=f"{reason}; per-layer checkpointing of {names} ({n_layers} layers)",
    )


def size_fallback(model: str, run: CheckpointedRun, plan: Plan, call: Call,
                  meter: Callable[[], int | None]) -> tuple[Plan, str] | None:
    """Choose how many of ``run``'s layers are checkpointed from ``meter()``'s peaks of its step (NOTE [metered
    fallback]): the fallback ``plan`` recording the choice and a line saying it, or None when the step is not
    metered (every layer stays checkpointed): it could not be, or the model has hooks a metered step would run
    again.  Raises :class:`InfeasibleBudgetError` before the caller's step runs when every layer checkpointed
    measures above the budget."""
    assert plan.fallback
    usable = plan.budget_bytes - safety_margin(plan.budget_bytes) - allocator_slack(call.device)
    n = len(run.layers)
    hooks = user_hooks(run.module)
    if hooks:
        log.warning("remat_plugin: the fallback step of %s is not metered: a metered step would run its hooks (%s) "
                    "again. Every one of its %d layers is checkpointed, the budget of %s not verified", model,
                    ", ".join(hooks[:3]) + (", ..." if len(hooks) > 3 else ""), n, human_bytes(plan.budget_bytes))
        return None

    def metered() -> int | None:  # each from autocast's cast cache empty, as the caller's step after them starts
        torch.clear_autocast_cache()
        try:
            return meter()
        finally:
            torch.clear_autocast_cache()

    run.count = 0
    with run.ordered_by_saved_bytes():
        unmodified = metered()
    if unmodified is None and run.hooks_refused:  # torch.func refused the count's hooks: metered again without
        return _size_unrecomputable(model, run, plan, call, metered(), usable)
    if unmodified is None:
        run.count = n
        log.warning("remat_plugin: the fallback step of %s could not be metered; every one of its %d layers is "
                    "checkpointed, the budget of %s not verified", model, n, human_bytes(plan.budget_bytes))
        return None
    peaks = {0: unmodified}
    if unmodified > usable:
        run.count = n
        every = metered()
        peaks[n] = every if every is not None else unmodified
        if peaks[n] > usable:
            raise InfeasibleBudgetError(plan.budget_bytes, budget_for_peak(peaks[n]),
                                        what=f"step of {model} with each of its {n} layers checkpointed (it has no "
                                             "graph, so it was measured: NOTE [metered fallback])")
        over, within = 0, n  # the most layers measured over the usable budget, the fewest within it
        for _ in range(MAX_SIZINGS):
            if within - over <= 1:
                break
            share = (peaks[over] - usable) / max(peaks[over] - peaks[within], 1)  # along the line between the two
            run.count = min(max(over + int(-(-(within - over) * share // 1)), over + 1), within - 1)
            peak = metered()
            if peak is None:
                break
            peaks[run.count] = peak
            over, within = (over, run.count) if peak <= usable else (run.count, within)
        run.count = within
    sized = dataclasses.replace(
        plan, predicted_peak_bytes=peaks[run.count], baseline_peak_bytes=unmodified,
        min_feasible_bytes=budget_for_peak(peaks[n]) if n in peaks else -1,
        blocks=tuple(BlockChoice(i, 0, "checkpoint" if i in run.checkpointed else "keep", -1, -1.0) for i in range(n)))
    said = (f"remat_plugin: {model}'s fallback checkpoints {run.count} of its {n} layers: measured "
            f"{human_bytes(peaks[run.count])} under a {human_bytes(plan.budget_bytes)} budget (unmodified "
            f"{human_bytes(unmodified)}; metered on {call.signature.describe()})")
    return sized, said


def _size_unrecomputable(model: str, run: CheckpointedRun, plan: Plan, call: Call, unmodified: int | None,
                         usable: int) -> tuple[Plan, str] | None:
    """A fallback none of whose layers can be checkpointed (torch.func refuses the saved-tensor hooks): it runs
    unmodified if that ``unmodified`` peak fits, else :class:`InfeasibleBudgetError` before the caller's step."""
    n = len(run.layers)
    if unmodified is None:
        log.warning("remat_plugin: the fallback step of %s could not be metered, and none of its layers can be "
                    "checkpointed (torch.func); it runs unmodified, the budget of %s not verified", model,
                    human_bytes(plan.budget_bytes))
        return None
    if unmodified > usable:
        raise InfeasibleBudgetError(plan.budget_bytes, budget_for_peak(unmodified),
                                    what=f"step of {model}, none of whose {n} layers can be recomputed (they run "
                                         "under a torch.func transform, which refuses checkpointing's saved-tensor "
                                         "hooks; measured)")
    sized = dataclasses.replace(plan, predicted_peak_bytes=unmodified, baseline_peak_bytes=unmodified,
                                min_feasible_bytes=budget_for_peak(unmodified),
                                blocks=tuple(BlockChoice(i, 0, "keep", -1, -1.0) for i in range(n)))
    return sized, (f"remat_plugin: {model}'s fallback checkpoints none of its {n} layers (they run under a torch.func "
                   f"transform): measured {human_bytes(unmodified)} under a {human_bytes(plan.budget_bytes)} budget "
                   f"(metered on {call.signature.describe()})")
