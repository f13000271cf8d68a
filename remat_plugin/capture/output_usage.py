"""What the caller does with a planned step's outputs, seen from the forward's return to the backward.

A plan may free an output once the forward returns it, or give it no gradient, only if the caller
drops it or takes none (NOTE [output usage] in :mod:`remat_plugin.runtime.resolver`).  The step's
differentiable outputs pass through :class:`_WatchedOutputs`, an identity whose backward runs before
the planned one: it records which outputs are still held and which a gradient reached
(:class:`OutputUsage`), and refuses a double backward before any gradient is computed.

It also tells which calls of a module are still in flight (NOTE [calls in flight]).
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from remat_plugin.errors import RematError
from remat_plugin.torch_private import StorageWeakRef, any_autocast_enabled, pytree, queue_after_backward

log = logging.getLogger(__name__)


class DoubleBackwardError(RematError):
    """``create_graph=True`` through a planned step: its backward is one program autograd cannot differentiate."""


@dataclass(frozen=True)
class OutputUsage:
    """What the caller did with one call's tensor outputs (flat positions), seen as its backward began."""

    n_outputs: int
    held: frozenset[int]  # still referenced (or a view of them is)
    graded: frozenset[int]  # a gradient reached them
    backward_autocast: bool = False  # the backward ran inside a torch.autocast block
    differentiable: frozenset[int] = frozenset()  # those that carried a gradient into the step
    output_bytes: tuple[int, ...] = ()  # each output's size (0 for one that is not a tensor)

    @property
    def dropped(self) -> frozenset[int]:
        """Outputs neither held nor differentiated: the step may free them once the forward returns them."""
        return frozenset(range(self.n_outputs)) - self.held - self.graded

    @staticmethod
    def combined(usages: list[OutputUsage]) -> OutputUsage:
        """What several ranks' callers did together: held or differentiated on any rank counts."""
        first = usages[0]
        return OutputUsage(first.n_outputs, frozenset().union(*(u.held for u in usages)),
                           frozenset().union(*(u.graded for u in usages)), first.backward_autocast,
                           frozenset().union(*(u.differentiable for u in usages)), first.output_bytes)

    @property
    def ungraded(self) -> frozenset[int]:
        """Outputs held but reached by no gradient: the backward need not take one (NOTE [dropped tangents])."""
        return (self.held & self.differentiable) - self.graded


def tensor_leaves(output: Any) -> list[torch.Tensor]:
    """A step's tensor outputs, flat, in pytree order."""
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]


def loss_index(outputs: list[torch.Tensor], scalar_only: bool = False) -> int | None:
    """Where a step's backward starts: the first scalar output with a gradient (the loss), else (unless
    ``scalar_only``) the first output with one."""
    graded = [i for i, t in enumerate(outputs) if t.requires_grad and t.is_floating_point()]
    return next((i for i in graded if outputs[i].numel() == 1), None if scalar_only or not graded else graded[0])


def when_backward_starts(outputs: list[torch.Tensor], root: int,
                         seen: Callable[[frozenset[int], tuple[int, ...]], None]) -> None:
    """As the backward from ``outputs[root]`` begins, ``seen(held, sizes)``: the outputs the caller still holds,
    by weak reference (to an output's base where it is a view: the view keeps it alive), and each one's bytes.
    For a step whose programs are not ours (a fallback, FSDP2's units): a planned step has :func:`watched`."""
    refs = [weakref.ref(t._base if t._base is not None else t) for t in outputs]
    sizes = tuple(t.nbytes for t in outputs)

    def backward_starts(grad: torch.Tensor) -> None:
        seen(frozenset(i for i, ref in enumerate(refs) if ref() is not None), sizes)

    outputs[root].register_hook(backward_starts)


class _OutputWatch:
    """One call's outputs, by weak reference to their storage's base tensor: a view the caller keeps keeps it.

    Outputs the plan frees after the forward (``freed``) are watched by their storage instead: nothing of the
    step holds it then, so a live storage means the caller holds some tensor on it, a ``detach()``-ed copy
    included (Lightning keeps a ``training_step``'s extra outputs that way), which a tensor's weak reference
    misses.  The others are watched by tensor as the backward begins, when the step itself may hold their
    storage for the backward; those that look dropped then are looked at again by their storage once the
    backward has finished and released what it saved (``amend``): a live storage then is the caller's copy,
    and the usage is amended to hold it, so the next plan does not free what the caller keeps.
    """

    def __init__(self, outputs: tuple, differentiable: list[int], record: Callable[[OutputUsage], None],
                 backward_autocast: bool, freed: frozenset[int] = frozenset(),
                 amend: Callable[[OutputUsage, OutputUsage], None] | None = None):
        self.node: Callable[[], Any] = lambda: None  # the step's backward node (weakly), once applied
        self.refs = [weakref.ref(t._base if t._base is not None else t) for t in outputs]
        self.storages = {i: StorageWeakRef(t.untyped_storage()) for i, t in enumerate(outputs)
                         if isinstance(t, torch.Tensor)}
        self.pointers = {i: t.untyped_storage().data_ptr() for i, t in enumerate(outputs)
                         if isinstance(t, torch.Tensor)}
        self.freed = freed
        self.nbytes = tuple(t.nbytes if isinstance(t, torch.Tensor) else 0 for t in outputs)
        self.differentiable = differentiable
        self.record = record
        self.amend = amend
        self.backward_autocast = backward_autocast  # where the step's backward was traced for

    def seen(self, grads: tuple) -> None:
        graded = {i for i, g in zip(self.differentiable, grads) if g is not None}
        held = {i for i, ref in enumerate(self.refs) if ref() is not None}
        alive = {i for i in self.freed if i in self.storages and not self.storages[i].expired()}
        # A freed output on a storage the step saved for its backward (a hidden state that is also a layer's
        # input) is alive for the step's sake: whether the caller holds it too is seen once the backward is over.
        saved = _saved_storages(self.node()) if alive else {}
        held |= {i for i in alive if self.pointers[i] not in saved}
        autocast = any_autocast_enabled()  # the engine runs backward under the caller's autocast
        if autocast != self.backward_autocast:
            where = "inside" if autocast else "after"
            log.warning("remat_plugin: backward() ran %s the torch.autocast block, where this step was traced for "
                        "the other place; autocast changes the backward's casts, so this step's gradients may "
                        "differ from eager PyTorch's in rounding. Its next call is traced for backward() %s "
                        "the block", where, where)
        usage = OutputUsage(len(self.refs), frozenset(held), frozenset(graded), autocast,
                            frozenset(self.differentiable), self.nbytes)
        self.record(usage)
        looked_dropped = [i for i in usage.dropped - (self.freed - alive) if i in self.storages]
        if looked_dropped and self.amend is not None:
            queue_after_backward(lambda: self._held_after_backward(usage, looked_dropped))

    def _held_after_backward(self, usage: OutputUsage, looked_dropped: list[int]) -> None:
        alive = {i for i in looked_dropped if not self.storages[i].expired()}
        if alive and self.amend is not None:
            self.amend(usage, replace(usage, held=usage.held | alive))


class _WatchedOutputs(torch.autograd.Function):
    """Identity on the step's differentiable outputs.  Its backward, which runs before the planned one:

    - refuses ``create_graph=True`` before any gradient is computed (AOTAutograd would run the planned
      backward and fail only at the second backward, with its own message);
    - tells the watch which outputs are still held and which a gradient reached (``OutputUsage``).
    """

    @staticmethod
    def forward(ctx, watch: _OutputWatch, *outputs: torch.Tensor):  # type: ignore[override]
        ctx.watch = watch
        watch.node = weakref.ref(ctx)  # ctx is this call's backward node: its inputs' nodes hold what the step saved
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: that is what we learn
        # Aliases, not views: autograd refuses in-place ops on the views a multi-output Function returns, and callers
        # scale the loss in place (transformers' Trainer: ``loss *= loss_scale``).  detach() shares the version
        # counter, so an in-place op on an output that the planned backward saved is still refused.
        return tuple(t.detach() for t in outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        if torch.is_grad_enabled():  # the engine enables grad mode in backward exactly when create_graph=True
            raise DoubleBackwardError(
                "remat_plugin.execute: backward(create_graph=True) or torch.autograd.grad(..., create_graph=True) "
                "through a rematerialized step is not supported: its planned backward is one compiled program, "
                "which autograd cannot differentiate again (double backward, gradient penalties). Compute the "
                "double-backward term with the unmodified module (run that call in eval mode or under "
                "RematModule.original), or call backward without create_graph")
        ctx.watch.seen(grads)
        return (None, *grads)


def watched(outputs: tuple, record: Callable[[OutputUsage], None], backward_autocast: bool,
             freed: frozenset[int] = frozenset(),
             amend: Callable[[OutputUsage, OutputUsage], None] | None = None,
             owner: torch.Tensor | None = None) -> tuple:
    """``outputs`` with those that carry gradients routed through :class:`_WatchedOutputs`; ``freed``: those the
    plan frees after the forward; ``amend``: told the usage again once the backward is over, where it found more
    held (:class:`_OutputWatch`); ``owner``: what :func:`in_flight` is asked about (the module's first
    parameter)."""
    index = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not index:
        return outputs
    watch = _OutputWatch(outputs, index, record, backward_autocast, freed, amend)
    if owner is not None:
        _calls_of(owner, add=True).add(watch)  # type: ignore[union-attr]
    wrapped = _WatchedOutputs.apply(watch, *(outputs[i] for i in index))
    out = list(outputs)
    for i, t in zip(index, wrapped):
        out[i] = t
        watch.refs[i] = weakref.ref(t)  # what the caller holds: an alias, which does not keep ``outputs[i]`` alive
    return tuple(out)


# NOTE [calls in flight]
#     A plan's budget holds one call at a time: its forward's saved tensors are freed by its backward
#     before the next call.  A loop that calls the module again before the first call's backward (two
#     halves of a batch, a siamese pair, DPO's chosen and rejected sequences) runs the second call beside
#     everything the first one saved: measured on gpt2-tiny at half its peak, 112.08 MiB against a budget
#     of 59.47 MiB, with no word.  So every watched call is recorded by its owner (the module's first
#     parameter), and a call that finds earlier ones in flight counts what they hold: the tensors their
#     backward nodes saved (parameters aside), read from the nodes as long as the graph is
#     alive and not yet backpropagated (a backward without ``retain_graph`` frees them; a graph the
#     caller dropped is gone).  The resolver refuses a call that would then exceed its plan's budget
#     (``InfeasibleBudgetError``, naming the fix) before anything of it runs.
# id(owner) -> (the owner, weakly; its calls): a tensor cannot key a WeakKeyDictionary (its == is elementwise)
_CALLS: dict[int, tuple[weakref.ref, weakref.WeakSet[_OutputWatch]]] = {}


def _calls_of(owner: torch.Tensor, add: bool = False) -> weakref.WeakSet[_OutputWatch] | None:
    key = id(owner)
    entry = _CALLS.get(key)
    if entry is None or entry[0]() is not owner:  # a dead owner's id may be reused
        if not add:
            return None
        entry = _CALLS[key] = (weakref.ref(owner, lambda _: _CALLS.pop(key, None)), weakref.WeakSet())
    return entry[1]


def in_flight(params: list[torch.Tensor]) -> tuple[int, int]:
    """(calls, bytes): the earlier calls of the step owning ``params`` (the module's parameters and buffers, the
    first one its owner) whose backward has not run yet, and the bytes their saved tensors hold, each storage
    once, ``params``' own not counted."""
    calls_of = _calls_of(params[0]) if params else None
    watches = list(calls_of) if calls_of is not None else []
    if not watches:
        return 0, 0
    skip = {p.untyped_storage().data_ptr() for p in params}
    calls, storages = 0, {}
    for watch in watches:
        held = {ptr: n for ptr, n in _saved_storages(watch.node()).items() if ptr not in skip}
        if held:
            calls += 1
            storages.update(held)
    return calls, sum(storages.values())


def _saved_storages(node: Any) -> dict[int, int]:
    """``data_ptr() -> nbytes`` of the storages a call's step saved for its backward, read from the nodes below its
    :class:`_WatchedOutputs` node ``node``; empty once its backward freed them, or when ``node`` is gone."""
    storages = {}
    for below, _ in (node.next_functions if node is not None else ()):
        try:
            saved = below.saved_tensors if below is not None else ()
        except (RuntimeError, AttributeError):  # freed by its backward, or a node that saves nothing
            continue
        for t in saved:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return storages


def outputs_beside_the_loss(n_outputs: int, scalars: list[int]) -> frozenset[int] | None:
    """The flat tensor outputs other than the loss, when a call returns one floating scalar (the loss) beside
    other tensors; else None.  A training step differentiates only the loss, so these are what a plan may hold
    without a gradient (NOTE [loss-only first plan] in :mod:`remat_plugin.runtime.resolver`)."""
    if len(scalars) != 1 or n_outputs < 2:
        return None
    return frozenset(range(n_outputs)) - {scalars[0]}
