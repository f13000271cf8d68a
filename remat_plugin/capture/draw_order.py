"""In-place random fills of a fresh tensor, drawn in the order eager draws them.

NOTE [draw order]
    Eager's ``torch.empty_like(x).bernoulli_(p)`` (CPU dropout's noise in bf16/fp16, ``dropout_``,
    ``alpha_dropout``, a model's own masks) fills ``x``'s layout and draws in its memory order.  The
    functionalized trace records ``bernoulli(empty_like(x), p)``, whose result is laid out row-major and
    drawn in that order, so over a transposed ``x`` (a BatchNorm1d's output transposed back, as SegFormer and
    PatchTST do) each element got another draw than eager's: another mask, a bf16 SegFormer's loss 1e-3 off.
    Each such ``bernoulli`` becomes :func:`bernoulli_in_memory_order`, which is eager's in-place fill itself
    (the same op, the same generator), laid out as ``x``.  The values computed from it are eager's; their traced
    strides may be stale, which the programs' views tolerate (NOTE [views of mistraced strides]).
"""
from __future__ import annotations

import torch
from torch import fx

_FRESH = {torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format,
          torch.ops.aten.empty_strided.default, torch.ops.aten.new_empty.default,
          torch.ops.aten.new_empty_strided.default}


@torch.library.custom_op("remat_plugin::bernoulli_in_memory_order", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def bernoulli_in_memory_order(fresh: torch.Tensor, p: float) -> torch.Tensor:
    """``fresh.bernoulli_(p)`` on a tensor laid out as ``fresh``: eager's in-place fill, drawn in ``fresh``'s
    memory order (``fresh`` is read for its layout only)."""
    return torch.empty_like(fresh).bernoulli_(p)


@bernoulli_in_memory_order.register_fake
def _(fresh: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(fresh)


def draws_in_memory_order(gm: fx.GraphModule) -> int:
    """Rewrite the joint graph's ``bernoulli`` fills of fresh tensors as eager draws them (NOTE [draw order]);
    how many."""
    done = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.bernoulli.p)):
        if len(node.args) != 2 or node.kwargs.get("generator") is not None:
            continue  # a generator of the model's own: left as traced
        fresh, p = node.args
        if not (isinstance(p, float) and isinstance(fresh, fx.Node) and fresh.target in _FRESH
                and isinstance(fresh.meta.get("val"), torch.Tensor)):
            continue
        node.target = torch.ops.remat_plugin.bernoulli_in_memory_order.default
        node.kwargs = {}
        value = fresh.meta["val"]
        with value.fake_mode:
            node.meta["val"] = torch.empty_like(value)
        done += 1
    return done  # no recompile: the joint module's code never runs; the programs emitted from its graph do
