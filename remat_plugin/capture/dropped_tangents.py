"""Outputs the caller drops get no gradient: their tangents stay out of the planned backward.

NOTE [dropped tangents]
    The joint graph has a tangent input for every differentiable output, added into the
    gradient that reaches it from the loss (``add(tangents_2, grad)`` for the logits beside
    ``.loss``).  When the caller drops the output, autograd would fill its missing gradient with
    a logits-sized zero tensor before AOTAutograd's node runs, and the program would add it: a
    logits tensor of memory at the start of the backward, and an op, for nothing (gpt2-tiny's
    keep-all peak is 7.81 MiB lower without them: ``python -m remat_plugin.bench dropped-outputs``).

    The same holds for an output the caller keeps but takes no gradient of (``out = model(...);
    out.loss.backward()`` holds the logits through the backward).  For an output the plan drops
    (NOTE [dropped outputs] in :mod:`remat_plugin.capture.joint`) or gives no gradient
    (``Plan.ungraded_outputs``), each such ``add`` becomes ``add_if_given(grad, tangent)``: the
    gradient itself when the tangent is None, the very same add when a caller did differentiate
    the output after all
    (that step then runs above its plan by one output's size, and the resolver re-plans for
    the output's gradient, NOTE [output usage]).  The planner sees it as a view of the
    gradient and the tangent as 0 bytes.  AOTAutograd's node is told not to materialize missing
    gradients (:func:`keep_missing_gradients`); the backward program fills those of the other
    tangents with zeros itself, as autograd did (:class:`FilledTangents`).

NOTE [relaid tangents]
    A tangent is laid out as its output, and the sum ``add(tangent, grad)`` takes the tangent's strides
    where the two differ.  Eager autograd, given no gradient for the output, passes ``grad`` on as it is.
    A segmentation head returns channels-last logits whose gradient comes back row-major from the
    loss's resize: the zero tangent made the sum channels-last, the head's bias gradient summed its
    elements in another order, and a SegFormer trained with its logits held (too small a share of
    the peak to plan again without them) stayed 1.7e-18 off eager's at every step.  Where every read
    of a tangent adds it into a gradient laid out otherwise (:func:`relaid_tangents`), a missing
    tangent is filled with zeros laid out as that gradient, so the sum is laid out as eager's and is
    bit for bit ``grad``.  Such a sum runs with other strides than traced, as a folded one does, so
    what follows it stays out of place (NOTE [in-place adds]).  A tangent the caller does send is
    added as traced.  Compiled programs take their inputs as traced and are left as they are.

NOTE [gradients no tangent reaches]
    Eager autograd leaves ``.grad`` None for a parameter the loss does not reach: a pooler whose output the
    caller ignores (``YolosModel``'s or ``ViTModel``'s ``pooler_output`` beside ``last_hidden_state``).  The
    backward program computed that parameter's gradient from the output's tangent, filled with zeros, and
    returned zeros: ``.grad`` became a zero tensor, which an optimizer does not skip (AdamW decays the
    weight and moves its moments; eager leaves it untouched).  A gradient is linear in the tangents it
    reads, so where every tangent it reads arrived missing it is exactly nothing: the program returns None
    for it (:func:`tangents_read`), as eager does.  A tangent the caller sends, zeros included, is read as
    sent.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import fx

from remat_plugin.capture.switches import CaptureSwitch
from remat_plugin.torch_private import is_tangent, tangent_output

log = logging.getLogger(__name__)
_folding = CaptureSwitch()


def tangents_materialized() -> contextlib.AbstractContextManager[None]:
    """Steps captured inside leave dropped outputs' tangents to autograd, as before NOTE [dropped tangents]:
    the baseline ``python -m remat_plugin.bench dropped-outputs`` measures against."""
    return _folding.off()


def add_if_given(grad: torch.Tensor, tangent: torch.Tensor | None) -> torch.Tensor:
    """``tangent + grad`` as the joint graph computed it, or ``grad`` itself when no tangent arrived."""
    if tangent is None:
        return grad
    return torch.ops.aten.add.Tensor(tangent, grad)


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.shape == vb.shape
            and va.dtype == vb.dtype and va.device == vb.device)


def _folded_grad(add: fx.Node, tangent: fx.Node) -> fx.Node | None:
    """The other operand of ``add(tangent, grad)`` (either order) when the add is exactly ``grad`` for a zero
    tangent: no alpha, no broadcast or type promotion; else None."""
    if add.target is not torch.ops.aten.add.Tensor or add.kwargs or len(add.args) != 2:
        return None
    a, b = add.args
    grad = b if a is tangent else a if b is tangent else None
    if not isinstance(grad, fx.Node) or grad is tangent or not _same_layout(grad, add):
        return None
    return grad


def fold_dropped_tangents(gm: fx.GraphModule, outputs: frozenset[int]) -> frozenset[str]:
    """Rewrite the joint graph's adds of these outputs' tangents into :func:`add_if_given`; the tangents'
    names (a tangent read any other way is left as it is, materialized as before)."""
    if not (outputs and _folding.on):
        return frozenset()
    folded: set[str] = set()
    for ph in gm.graph.find_nodes(op="placeholder"):
        if not (is_tangent(ph) and tangent_output(ph) in outputs):
            continue
        grads = {user: _folded_grad(user, ph) for user in ph.users}
        if not all(grads.values()):
            log.debug("dropped tangents: %s is read by %s; it stays materialized", ph.name,
                      [u.target for u, g in grads.items() if g is None])
            continue
        for add, grad in grads.items():
            with gm.graph.inserting_before(add):
                new = gm.graph.call_function(add_if_given, (grad, ph))
            new.meta = dict(add.meta)
            add.replace_all_uses_with(new)
            gm.graph.erase_node(add)
        folded.add(ph.name)
    return frozenset(folded)


def _densely_laid_out(value: torch.Tensor) -> bool:
    """Laid out without gaps or overlaps (a permutation of a row-major tensor), as a fresh sum is."""
    expected = 1
    for size, stride in sorted(zip(value.shape, value.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def relaid_tangents(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Tangents every read of which adds them into a gradient laid out otherwise than the sum -> that gradient's
    traced value, whose layout a missing tangent's zeros take (NOTE [relaid tangents]).  Folded tangents are
    read by ``add_if_given`` and are not among them."""
    relaid: dict[str, torch.Tensor] = {}
    for ph in gm.graph.find_nodes(op="placeholder"):
        if not (is_tangent(ph) and ph.users and isinstance(ph.meta.get("val"), torch.Tensor)):
            continue
        grads = {add: _folded_grad(add, ph) for add in ph.users}
        if not all(grads.values()):
            continue
        values = [grad.meta["val"] for grad in grads.values() if grad is not None]
        if (len({v.stride() for v in values}) != 1 or values[0].shape != ph.meta["val"].shape
                or not _densely_laid_out(values[0])):
            continue
        if any(traced_strides(grad) != traced_strides(add) for add, grad in grads.items() if grad is not None):
            relaid[ph.name] = values[0]
    return relaid


def relaid_sums(gm: fx.GraphModule) -> list[fx.Node]:
    """The adds of :func:`relaid_tangents`: they run laid out as their gradient when the tangent is missing."""
    relaid = relaid_tangents(gm)
    return [add for ph in gm.graph.find_nodes(op="placeholder") if ph.name in relaid for add in ph.users]


def traced_strides(node: fx.Node) -> tuple[int, ...] | None:
    """A node's strides as traced (None for a value that is not one tensor)."""
    value = node.meta.get("val")
    return tuple(value.stride()) if isinstance(value, torch.Tensor) else None


def keep_missing_gradients(node) -> None:
    """Have AOTAutograd's node pass a missing output gradient on as None instead of a zero tensor."""
    node.set_materialize_grads(False)


def tangents_read(gm: fx.GraphModule) -> list[tuple[int, frozenset[int]]]:
    """Each output of ``gm`` (a backward program or the joint graph) that reads tangents -> the positions, among
    ``gm``'s placeholders, of the tangents it reads, directly or not (NOTE [gradients no tangent reaches])."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    reads: dict[fx.Node, int] = {ph: 1 << i for i, ph in enumerate(placeholders) if is_tangent(ph)}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            bits = 0
            for arg in node.all_input_nodes:
                bits |= reads.get(arg, 0)
            if bits:
                reads[node] = bits
    output = next(iter(gm.graph.find_nodes(op="output")))
    out = []
    for j, value in enumerate(output.args[0]):
        bits = reads.get(value, 0) if isinstance(value, fx.Node) else 0
        if bits:
            out.append((j, frozenset(i for i in range(len(placeholders)) if bits >> i & 1)))
    return out


def some_gradient_reads_part_of_the_tangents(gm: fx.GraphModule) -> bool:
    """Whether a missing tangent can leave a gradient with nothing to read: one reads tangents, not all of them."""
    tangents = frozenset(i for i, ph in enumerate(gm.graph.find_nodes(op="placeholder")) if is_tangent(ph))
    return any(read != tangents for _, read in tangents_read(gm))


class FilledTangents:
    """A backward program whose missing tangents, other than the folded ones, arrive as zeros, as autograd
    filled them before :func:`keep_missing_gradients`, or laid out as the gradient they are added into
    (``relaid``, NOTE [relaid tangents]); a gradient that reads only missing tangents is None (NOTE [gradients
    no tangent reaches]).  Called with AOTAutograd's boxed convention."""

    _boxed_call = True

    def __init__(self, program: Callable[[list], tuple], gm: fx.GraphModule, folded: frozenset[str],
                 relaid: dict[str, torch.Tensor]):
        self.program = program
        self.fill: list[tuple[int, torch.Tensor]] = [
            (i, relaid.get(ph.name, ph.meta["val"])) for i, ph in enumerate(gm.graph.find_nodes(op="placeholder"))
            if is_tangent(ph) and ph.name not in folded and isinstance(ph.meta.get("val"), torch.Tensor)
        ]
        self.tangents = [i for i, ph in enumerate(gm.graph.find_nodes(op="placeholder")) if is_tangent(ph)]
        self.reads = tangents_read(gm)

    def __call__(self, args: list) -> tuple:
        missing = {i for i in self.tangents if args[i] is None}
        for i, val in self.fill:
            if args[i] is None:
                args[i] = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype,
                                              device=val.device).zero_()
        unreached = frozenset(j for j, read in self.reads if read <= missing) if missing else frozenset()
        # a segmented backward returns later segments' gradients through nodes of its own: it is told
        told = unreached and getattr(self.program, "takes_unreached", False)
        out = self.program(args, unreached) if told else self.program(args)  # type: ignore[call-arg]
        if not unreached:
            return out
        grads = list(out)
        for j in unreached:
            grads[j] = None
        return type(out)(grads) if isinstance(out, tuple) else grads

