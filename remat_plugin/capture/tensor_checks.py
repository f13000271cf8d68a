"""Checks of tensor values in the forward, kept as checks the planned step makes when it runs.

NOTE [tensor checks]
    ``torch._check_tensor_all(cond)``, and transformers' ``torch_compilable_check`` on a tensor (LLaVA's
    image tokens counted against its image features before ``masked_scatter``), export as
    ``item(_is_all_true(cond))`` and scalar assertions on that number: the graph reads a value, which
    AOTAutograd's trace at fixed sizes cannot (``DataDependentOutputException``), so such a model fell
    back to per-layer checkpointing.  Each such check becomes one opaque op,
    ``remat_plugin::check_all_true(cond, where)``: while tracing it reads nothing; when the step runs it
    reads the condition, as eager does (one host sync), and raises ``ValueError`` naming the model's line
    when it is False.  The message the model gave is not in the exported graph (export keeps only its
    assertion); the line is.  Other scalar reads (``x.item()`` used as a size) stay untraceable.  A check
    inside a repeated layer read its value again while the layer's fingerprint ran under the model's
    export, which refused the number nothing returned, and every layer was traced; the fingerprint now
    lets such numbers be (``torch_private.unbacked_reads_ignored``), so the layers are traced once.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

_ITEM = torch.ops.aten.item.default
_ALL_TRUE = torch.ops.aten._is_all_true.default
_ASSERT = torch.ops.aten._assert_scalar.default


@torch.library.custom_op("remat_plugin::check_all_true", mutates_args=())
def check_all_true(cond: torch.Tensor, where: str) -> None:
    """Raise ``ValueError`` unless every element of ``cond`` is true (NOTE [tensor checks])."""
    if not bool(cond.all()):
        raise ValueError(f"remat_plugin: a check in the model's forward failed for this batch ({where}); eager "
                         f"PyTorch raises there too, with the model's own message")


@check_all_true.register_fake
def _(cond: torch.Tensor, where: str) -> None:
    return None


torch.fx.node.has_side_effect(torch.ops.remat_plugin.check_all_true.default)  # never dropped as unused


def opaque_tensor_checks(gm: fx.GraphModule) -> int:
    """Replace each exported ``item(_is_all_true(cond))`` that only feeds scalar assertions by one
    ``check_all_true`` (NOTE [tensor checks]); how many."""
    replaced = 0
    for item in list(gm.graph.find_nodes(op="call_function", target=_ITEM)):
        source = item.args[0]
        if not (isinstance(source, fx.Node) and source.target is _ALL_TRUE):
            continue
        checks = _assertions_of(item)
        if checks is None:
            continue
        with gm.graph.inserting_before(item):
            gm.graph.call_function(torch.ops.remat_plugin.check_all_true.default, (source, _where(item)))
        for node in reversed(checks):
            gm.graph.erase_node(node)
        gm.graph.erase_node(item)
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def _assertions_of(item: fx.Node) -> list[fx.Node] | None:
    """The scalar ops and assertions reading ``item``, in graph order; None if anything else reads it."""
    seen: list[fx.Node] = []
    stack = list(item.users)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op != "call_function" or not (node.target is _ASSERT or _is_scalar_op(node.target)):
            return None
        seen.append(node)
        stack.extend(node.users)
    order = {n: i for i, n in enumerate(item.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _is_scalar_op(target) -> bool:
    """Python's comparisons and torch's symbolic helpers (``sym_ite``), as export writes them on a number."""
    return getattr(target, "__module__", None) in (operator.__name__, "_operator", "torch", "torch.fx.experimental.sym_node") \
        or getattr(target, "__name__", "").startswith("sym_")


def traced_line(node: fx.Node) -> str | None:
    """The model's line ``node`` was traced from (its stack trace's innermost ``File ...``), if export kept it."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    lines = [t.strip() for t in trace if t.strip().startswith("File ")]
    return lines[-1] if lines else None


def _where(item: fx.Node) -> str:
    return traced_line(item) or "a torch._check_tensor_all"
