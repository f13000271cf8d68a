"""Sums into a dying operand: ``add(a, b)`` becomes ``a.add_(b)`` where nothing reads ``a`` afterwards.

NOTE [in-place adds]
    AOTAutograd's graphs are functional, so every sum of two gradients (a residual stream's, a
    weight shared by two ops) allocates a new tensor, where eager autograd adds into the
    buffer it already holds.  On CPU a fresh large allocation also costs its page faults: on
    gpt2-tiny (8x256, one thread) the planned step's 41 out-of-place adds took 111 ms against
    eager's 47 ms of adds and 16 ms of in-place ones.  Where one operand is an op's fresh
    result (no view, no alias of anything), read by this add alone, with the sum's shape,
    dtype and strides, the add writes into it instead.  IEEE addition is commutative, so
    ``b.add_(a)`` is bit for bit ``a + b``.  The planner counts the backward's sums written this
    way as the operand's storage (NOTE [in-place sums in the plan]).  Planned programs run by
    inductor are left functional.

    The sum's strides are those traced, and a folded tangent (NOTE [dropped tangents]) can make them
    stale: ``add_if_given`` returns the gradient itself where the trace added a tangent to it, so it
    runs laid out as that gradient, and so does everything computed elementwise from it.  CLIP's
    similarity reaches its loss directly and transposed, and the transposed gradient is the one its
    output's tangent was traced onto: the trace's sum was row-major, eager's (and the folded graph's,
    run out of place) column-major.  Written into the row-major operand, the logit scale's gradient
    summed in another order, one unit in the last place off eager's in half the batches.  An add
    whose operands or result may run with other strides than traced stays out of place; so does one
    after a sum whose missing tangent is filled laid out as its gradient (NOTE [relaid tangents]).

NOTE [in-place sums in the plan]
    The planner once counted every sum as a new tensor, so a step used less than it predicted by
    whatever sums were alive at its peak.  Where the peak is the backward's end, that is a whole
    weight's gradient: GPT-2 small's shape at 2 x 64 tokens sums its tied embedding's two
    gradients (147 MiB each), and its plan predicted 498.79 MiB for a step that measured 351.93.
    The rewrite depends only on the graph (an operand's users, its op, its layout), not on the
    schedule, so the joint graph says which of the backward's adds it will write into which
    operand the backward made (:func:`sums_in_place`); the problem gives such a sum no bytes of
    its own and keeps the operand alive while the sum is read (``JointGraph.to_problem``).  An add
    into a forward value (one a plan may keep or recompute) stays counted as new: the step can
    only use less than predicted there.  Compiled programs, left functional, keep every sum.
"""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Container

import torch
from torch import fx

from remat_plugin.capture.dropped_tangents import add_if_given, relaid_sums, traced_strides
from remat_plugin.capture.switches import CaptureSwitch
from remat_plugin.torch_private import OpOverload

_ADD = torch.ops.aten.add.Tensor
_ADD_ = torch.ops.aten.add_.Tensor
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
# Results laid out the same whatever their inputs' strides (row-major)
_FRESH_LAYOUT = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}
_rewriting = CaptureSwitch()


def adds_functional() -> contextlib.AbstractContextManager[None]:
    """Steps captured inside keep every add out of place, as before NOTE [in-place adds]: the baseline
    ``python -m remat_plugin.bench in-place-adds`` measures against."""
    return _rewriting.off()


def add_in_place(gm: fx.GraphModule) -> int:
    """Rewrite ``gm``'s adds whose operand dies there into in-place adds (NOTE [in-place adds]); how many."""
    if not _rewriting.on:
        return 0
    chosen = _sums_into(gm)
    for node, into in chosen.items():
        a, b = node.args
        node.target, node.args = _ADD_, (into, b if into is a else a)
    if chosen:
        gm.recompile()
    return len(chosen)


def sums_in_place(joint_gm: fx.GraphModule) -> dict[str, str]:
    """The joint graph's backward adds that :func:`add_in_place` will write into an operand the backward made, by
    name: add -> that operand (NOTE [in-place sums in the plan]).  Empty while the switch keeps adds out of place."""
    if not _rewriting.on:
        return {}
    return {node.name: into.name for node, into in _sums_into(joint_gm).items()
            if _in_backward(node) and _in_backward(into)}


def _in_backward(node: fx.Node) -> bool:
    """A joint graph's node of the backward: AOTAutograd tags the forward's."""
    return node.meta.get("partitioner_tag") != "is_forward"


def _sums_into(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each add that can write into one of its operands (NOTE [in-place adds]) -> that operand, in graph order."""
    chosen: dict[fx.Node, fx.Node] = {}
    unsettled = _unsettled_layouts(gm)
    for node in gm.graph.find_nodes(op="call_function", target=_ADD):
        if node.kwargs or len(node.args) != 2 or not all(isinstance(a, fx.Node) for a in node.args):
            continue
        if node in unsettled or any(a in unsettled for a in node.args):
            continue
        a, b = node.args
        for into, other in ((a, b), (b, a)):
            if into is not other and _dies_here(into, node, chosen):
                chosen[node] = into
                break
    return chosen


def _unsettled_layouts(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that may run with other strides than traced (NOTE [in-place adds]): each folded tangent add whose
    gradient was traced with other strides than the sum, and what is computed from it up to an op whose
    result's layout does not follow its inputs' (a matrix product, a vector or scalar); likewise each sum of a
    relaid tangent (NOTE [relaid tangents])."""
    stack = [n for n in gm.graph.find_nodes(op="call_function", target=add_if_given)
             if isinstance(n.args[0], fx.Node) and traced_strides(n.args[0]) != traced_strides(n)]
    stack += relaid_sums(gm)
    unsettled: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in unsettled:
            continue
        unsettled.add(node)
        stack.extend(user for user in node.users if user.target not in _FRESH_LAYOUT and len(traced_strides(user) or ()) > 1)
    return unsettled


def _dies_here(value: fx.Node, add: fx.Node, rewritten: Container[fx.Node]) -> bool:
    """``value`` is a fresh tensor that only ``add`` reads, laid out as ``add``'s result."""
    if value.op != "call_function" or len(value.users) != 1:
        return False
    if not (value in rewritten or _makes_fresh_tensors(value)):
        return False
    got, want = value.meta.get("val"), add.meta.get("val")
    return (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.dtype == want.dtype
            and got.device == want.device and got.shape == want.shape and got.stride() == want.stride())


def _makes_fresh_tensors(node: fx.Node) -> bool:
    """An aten or custom op whose results alias nothing (for a getitem, the op it takes from).

    ``aten._unsafe_view`` declares no alias but returns a view of its input: it is fresh only when
    its input is, and nothing else reads that input (a recompute plan can keep it for the backward).
    """
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    target = node.target
    if target is _UNSAFE_VIEW:
        base = node.args[0]
        return (isinstance(base, fx.Node) and base.op == "call_function" and len(base.users) == 1
                and _makes_fresh_tensors(base))
    return isinstance(target, OpOverload) and all(r.alias_info is None for r in target._schema.returns)
