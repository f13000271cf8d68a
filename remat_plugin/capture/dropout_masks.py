"""Dropout as its random mask and a multiply, so a plan can keep the mask and recompute the output cheaply.

NOTE [dropout masks]
    ``aten.native_dropout`` makes a dropout's output and its mask in one op, and on CPU drawing
    the mask is most of its time: on gpt2-tiny (8x256, one thread) the dropouts are 103 of the
    forward's 319 ms of op time, and one on an 8x4x256x256 float32 input takes 15.8 ms, of which
    the draws 13.0 and the multiply 2.9.  A plan that frees a dropout's
    output had to run the whole op again, its draws replayed.  On CPU, for float32 and float64
    inputs, each ``native_dropout(x, p, train)`` of the joint graph becomes

        mask = dropout_mask(x, p)             # the draws: bernoulli_(1 - p) into empty_like(x), as bool
        out = apply_dropout_mask(x, mask, p)  # x * mask * (1 / (1 - p))

    which is what PyTorch's CPU kernel computes, bit for bit: the same draws from the same
    generator, the stream left where the kernel leaves it (``tests/test_dropout_masks.py``, on
    every torch the project supports).  Its ``native_dropout_backward(grad, mask, scale)`` becomes
    ``dropout_mask_backward``, the same product with the mask converted before the multiply (a
    third of the time, ``_times_mask``).  A plan may now keep the mask (one byte per element, a
    quarter of a float32 output) and recompute the output with one multiply.  The mask op takes
    ``x`` for its layout only; it stays in the planning problem as a reader of ``x``, which keeps
    each dropout in its layer's block (a mask reading nothing was a constant op, placed apart from
    its layer, and the layer blocks stopped being identical).  CUDA's fused kernel draws otherwise
    (Philox), and reduced precision rounds otherwise, so their dropouts stay as they are.
"""
from __future__ import annotations

import contextlib
import operator

import torch
from torch import fx

from remat_plugin.capture.switches import CaptureSwitch

_REWRITTEN_DTYPES = (torch.float32, torch.float64)
_splitting = CaptureSwitch()


def dropouts_as_traced() -> contextlib.AbstractContextManager[None]:
    """Steps captured inside keep each dropout one random op, as before NOTE [dropout masks]: the baseline
    ``python -m remat_plugin.bench dropout-masks`` measures against."""
    return _splitting.off()


@torch.library.custom_op("remat_plugin::dropout_mask", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def dropout_mask(x: torch.Tensor, p: float) -> torch.Tensor:
    """Which elements a CPU ``native_dropout`` of ``x`` keeps: its very draws, as a bool tensor of ``x``'s layout
    (``x`` is read for its layout only)."""
    return torch.empty_like(x).bernoulli_(1.0 - p).to(torch.bool)


@dropout_mask.register_fake
def _(x: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(x, dtype=torch.bool)


@torch.library.custom_op("remat_plugin::apply_dropout_mask", mutates_args=())
def apply_dropout_mask(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    """The dropout's output: ``x * mask`` scaled by ``1 / (1 - p)``, as the CPU kernel computes it."""
    return _times_mask(x, mask, 1.0 / (1.0 - p))


@apply_dropout_mask.register_fake
def _(x: torch.Tensor, mask: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("remat_plugin::dropout_mask_backward", mutates_args=())
def dropout_mask_backward(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``aten.native_dropout_backward`` (``grad * mask * scale``) with the bool mask made ``grad``'s dtype first."""
    return _times_mask(grad, mask, scale)


@dropout_mask_backward.register_fake
def _(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(grad)


def _times_mask(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * mask * scale``, bit for bit, the mask converted to ``x``'s dtype before the multiply: a float tensor
    times a bool one converts element by element inside the multiply, 3.4x the time (10.2 against 3.0 ms for
    8x4x256x256 float32, one thread).  The converted mask is the output, multiplied in place (a product of two
    numbers is the same either way round), so the op holds no ``x``-sized scratch beside its output.  The mask is
    read as bytes (a bool is stored as 0 or 1): CPU copies bytes to floats in vector lanes, bools one by one
    (0.71 against 2.19 ms for that input; the whole op 1.35 against 3.52 ms, 2026-11-30)."""
    return torch.empty_like(x).copy_(mask.view(torch.uint8) if mask.dtype == torch.bool else mask).mul_(x).mul_(scale)


def _rewritable(node: fx.Node) -> bool:
    if node.target is not torch.ops.aten.native_dropout.default or node.kwargs:
        return False
    x, p, *rest = node.args
    train = rest[0] if rest else None
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return (train is not False and isinstance(p, float) and 0.0 <= p < 1.0 and isinstance(val, torch.Tensor)
            and val.device.type == "cpu" and val.dtype in _REWRITTEN_DTYPES
            and all(u.target is operator.getitem for u in node.users))


def split_dropouts(gm: fx.GraphModule) -> int:
    """Rewrite the joint graph's CPU dropouts into a mask and a multiply (NOTE [dropout masks]); how many."""
    if not _splitting.on:
        return 0
    graph = gm.graph
    done = 0
    for node in list(graph.find_nodes(op="call_function", target=torch.ops.aten.native_dropout.default)):
        if not _rewritable(node):
            continue
        x, p = node.args[0], node.args[1]
        xval = x.meta["val"]  # type: ignore[union-attr]
        parts = {u.args[1]: u for u in node.users}
        with graph.inserting_before(node):
            mask = graph.call_function(torch.ops.remat_plugin.dropout_mask.default, (x, p))
            out = graph.call_function(torch.ops.remat_plugin.apply_dropout_mask.default, (x, mask, p))
        for index, made in ((0, out), (1, mask)):
            made.meta = {k: v for k, v in node.meta.items() if k != "val"}  # forward/backward tag, stack trace
            part = parts.get(index)
            if part is not None:
                made.meta["val"] = part.meta["val"]
                part.replace_all_uses_with(made)
                graph.erase_node(part)
        for user in list(mask.users):
            if user.target is torch.ops.aten.native_dropout_backward.default and not user.kwargs:
                with graph.inserting_before(user):  # a new node, so its name says what runs
                    grad_in = graph.call_function(torch.ops.remat_plugin.dropout_mask_backward.default, user.args)
                grad_in.meta = dict(user.meta)
                user.replace_all_uses_with(grad_in)
                graph.erase_node(user)
        with xval.fake_mode:  # an output nothing reads has no getitem to take it from
            mask.meta.setdefault("val", torch.empty_like(xval, dtype=torch.bool))
            out.meta.setdefault("val", torch.empty_like(xval))
        graph.erase_node(node)
        done += 1
    return done  # no recompile: the joint module's code never runs; the programs emitted from its graph do
