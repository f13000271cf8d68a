"""A weight autocast casts at several uses, cast once as eager's cast cache does.

NOTE [autocast's cast cache]
    Eager autocast casts an fp32 leaf that requires grad (a parameter) to its low precision once per
    ``torch.autocast`` block and hands the same cast to every later use (its cast cache), so the uses'
    gradients are summed in that precision and converted to fp32 once.  PyTorch's tracer turns the cache
    off, so the joint graph casts at each use and sums the converted gradients in fp32: a weight used
    several times (ALBERT's one shared layer, a backbone called on several crops, a Linear applied in a
    loop) got another rounding of its gradient than eager's.  Where the caller's autocast caches, every use
    of such a parameter is autocast's cast to that dtype, and its gradient is a sum of exactly those casts'
    converted gradients, the casts become the first one and the sum is taken in low precision, in the order
    the gradients arose, then converted once: eager's arithmetic.  A parameter also used otherwise (read in
    fp32 inside an ``autocast(enabled=False)`` region) keeps the traced graph, and so does one the model casts
    itself (``w.to(torch.bfloat16)``, which eager never caches): the exported program, traced above autocast,
    holds only the model's own casts (:func:`cast_by_the_model`).
"""
from __future__ import annotations

import operator
from typing import cast

import torch
from torch import fx

_CAST = torch.ops.aten._to_copy.default
_ADD = torch.ops.aten.add.Tensor


def _cast_to(node: fx.Node, dtype: torch.dtype) -> bool:
    """``node`` is ``_to_copy(x, dtype=dtype)`` and nothing else: how autocast casts."""
    return node.op == "call_function" and node.target is _CAST and len(node.args) == 1 \
        and dict(node.kwargs) == {"dtype": dtype}


def _converted_gradient(node: fx.Node, low: torch.dtype) -> bool:
    """``node`` converts a ``low``-precision gradient to fp32, as a cast's backward does."""
    value = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    return node.op == "call_function" and node.target is _CAST and node.kwargs.get("dtype") is torch.float32 \
        and isinstance(value, torch.Tensor) and value.dtype is low and len(node.users) == 1


def _sum_leaves(root: fx.Node) -> list[fx.Node] | None:
    """The terms of ``root`` when it is a tree of adds each read only by the next (a gradient's accumulation)."""
    if root.op == "call_function" and root.target is _ADD and len(root.args) == 2 and not root.kwargs:
        terms = []
        for arg in root.args:
            if not isinstance(arg, fx.Node) or (arg.target is _ADD and len(arg.users) != 1):
                return None
            inner = _sum_leaves(arg)
            if inner is None:
                return None
            terms += inner
        return terms
    return [root]


_MODEL_CASTS = {"aten::to", "aten::_to_copy", "aten::type_as"}


def cast_by_the_model(exported: fx.GraphModule) -> set[str]:
    """Names of the parameters the model's own code casts: conversions of them in the exported program, which
    records no autocast cast (NOTE [autocast's cast cache])."""
    out = set()
    for node in exported.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op == "call_function" and schema is not None and schema.name in _MODEL_CASTS and node.args:
            source = node.args[0]
            if isinstance(source, fx.Node) and source.op == "get_attr":
                out.add(str(source.target))
    return out


def share_parameter_casts(joint_gm: fx.GraphModule, params: list[fx.Node], grads: list[fx.Node | None],
                          low: torch.dtype) -> list[str]:
    """Cast each of ``params`` (placeholders of fp32 parameters that require grad) once, as eager's cast cache
    does, where the caller's autocast casts to ``low`` with its cache on (NOTE [autocast's cast cache]);
    ``grads[i]`` is the joint graph's gradient output for ``params[i]``.  The names of the parameters rewritten."""
    graph = joint_gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    shared = []
    for param, grad in zip(params, grads):
        casts = list(param.users)
        if len(casts) < 2 or grad is None or not all(_cast_to(c, low) for c in casts):
            continue
        terms = _sum_leaves(grad)
        if terms is None or len(terms) != len(casts) or not all(_converted_gradient(t, low) for t in terms):
            continue
        first = min(casts, key=order.__getitem__)
        for use in casts:
            if use is not first:
                use.replace_all_uses_with(first)
                graph.erase_node(use)
        gradients = sorted((cast(fx.Node, t.args[0]) for t in terms), key=order.__getitem__)  # as they arose
        total = gradients[0]
        for g in gradients[1:]:  # each added once it arises, as eager's gradient buffer adds it
            with graph.inserting_after(g):
                summed = _like(graph.call_function(_ADD, (total, g)), grad)
            summed.meta["val"] = _added(total.meta["val"], g.meta["val"])
            total = summed
        with graph.inserting_after(total):
            converted = _like(graph.call_function(_CAST, (total,), dict(terms[0].kwargs)), grad)
        converted.meta["val"] = grad.meta["val"]
        grad.replace_all_uses_with(converted)
        _erase_tree(graph, grad)
        shared.append(param.name)
    return shared


def _like(node: fx.Node, model: fx.Node) -> fx.Node:
    """``node`` tagged as ``model`` is for the partition (a backward op) and the log (its model line)."""
    for key in ("partitioner_tag", "stack_trace", "seq_nr"):
        if key in model.meta:
            node.meta[key] = model.meta[key]
    return node


def _added(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fake value of ``a + b``."""
    with a.fake_mode:  # type: ignore[attr-defined]
        return operator.add(a, b)


def _erase_tree(graph: fx.Graph, root: fx.Node) -> None:
    """Erase ``root`` and the adds and conversions beneath it, now read by nothing."""
    below = [a for a in root.args if isinstance(a, fx.Node)]
    graph.erase_node(root)
    for node in below:
        if not node.users and node.target in (_ADD, _CAST):
            _erase_tree(graph, node)
