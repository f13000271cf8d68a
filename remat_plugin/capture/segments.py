"""The planned backward in segments, so parameter gradients are released as the backward goes.

NOTE [segmented backward]
AOTAutograd runs the whole backward program inside one ``autograd.Function``, so every
gradient reaches autograd when the program ends: DDP's buckets cannot all-reduce while
the backward still computes, and ``register_post_accumulate_grad_hook`` (optimizer in
backward) fires only at the end.  Here the backward program is cut, after the ops that
finish gradients, into up to :data:`MAX_SEGMENTS` programs, and each call wires them as
a chain of autograd nodes:

    Release_{S-1} -> ... -> Release_1 -> Link(anchor) -> AOTAutograd's node -> outputs

Going backward, AOTAutograd's node runs segment 0 and returns the gradients it made
(the anchor, an input whose gradient segment 0 finishes, among them); ``Link`` hands a
token on to ``Release_1``, which runs segment 1 and returns its inputs' gradients, and so
on.  Inputs whose gradients a later segment makes enter AOTAutograd's node detached and
``Release_s`` as well, so autograd takes their gradients from ``Release_s``, where they
are final.  Values alive across a cut (saved tensors still to be read, the running
gradient of the residual stream) pass from segment to segment in the call's
:class:`_Call`; AOTAutograd's node learns its call through a pre-hook, since its backward
program is shared by every call.  The ops run in the same order and free their values at
the same points as the one program did, so the plan's memory model still holds.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import fx

from remat_plugin.capture.joint import is_view_target
from remat_plugin.errors import RematError
from remat_plugin.torch_private import BoxedCodeGen, any_autocast_enabled, autocast_disabled, lazy_graph_module

# At most this many autograd nodes per backward: each release costs a Python call (~30 us), and DDP's buckets
# (25 MiB by default) gain nothing from finer steps.
MAX_SEGMENTS = 8
MS_PER_SEGMENT = 10.0  # a segment per this much measured backward time, up to MAX_SEGMENTS

_current = threading.local()  # the call whose AOTAutograd node is about to run its backward (set by its pre-hook)


class SegmentError(RematError):
    """The segmented backward met a state it cannot continue from."""


@dataclass
class _Call:
    """One forward call's backward in flight: what segment ``next_segment`` needs to start."""

    backward: SegmentedBackward
    split: _Split  # the cuts it was wired with
    carry: list | None = None  # values alive across the last cut run
    next_segment: int = 0
    autocast: bool = False  # autocast was on inside AOTAutograd's backward (it disables it where it traced without)
    unreached: frozenset[int] = frozenset()  # output positions no tangent reached (NOTE [gradients no tangent reaches])


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _cuts(order: list[fx.Node], grad_nodes: set[fx.Node], max_segments: int) -> list[int]:
    """Positions in ``order`` after which a segment ends: after a gradient, once a share of them is made."""
    total = sum(_nbytes(n) for n in grad_nodes)
    if max_segments < 2 or total == 0:
        return []
    share = total / max_segments
    cuts: list[int] = []
    made = seen = 0
    for i, node in enumerate(order):
        if node in grad_nodes:
            made += _nbytes(node)
            seen += 1
            if made >= share * (len(cuts) + 1) and seen < len(grad_nodes) and len(cuts) < max_segments - 1:
                cuts.append(i + 1)
    return cuts


def _views_early(body: list[fx.Node], placeholders: list[fx.Node]) -> list[fx.Node]:
    """``body`` with each view that only outputs read moved right after its inputs.

    The executor derives an output's views (a bias gradient's ``view`` of its ``sum``, a
    ``t``) when it writes the output, at the program's end; a gradient is final where its
    base is made, and views cost nothing, so this lets the cut after it release it.
    """
    movable: set[fx.Node] = set()
    for n in reversed(body):
        if n.op == "call_function" and is_view_target(n.target) and all(
                u.op == "output" or u in movable for u in n.users):
            movable.add(n)
    order: list[fx.Node] = []
    done: set[fx.Node] = set(placeholders)

    def emit(n: fx.Node) -> None:
        order.append(n)
        done.add(n)
        release(n)

    def release(n: fx.Node) -> None:
        for u in n.users:
            if u in movable and u not in done and all(a in done for a in u.all_input_nodes):
                emit(u)

    for p in placeholders:
        release(p)
    for n in body:
        if n not in movable:
            emit(n)
    return order


class _Split:
    """The backward program cut into at most ``max_segments`` segment programs (fixed once made)."""

    def __init__(self, gm: fx.GraphModule, max_segments: int):
        graph = gm.graph
        placeholders = list(graph.find_nodes(op="placeholder"))
        out_node = next(n for n in graph.nodes if n.op == "output")
        outputs = list(out_node.args[0])
        body = _views_early([n for n in graph.nodes if n.op not in ("placeholder", "output")], placeholders)
        grad_nodes = {g for g in outputs if isinstance(g, fx.Node) and g.op != "placeholder"}
        bounds = [0, *_cuts(body, grad_nodes, max_segments), len(body)]
        self.n_outputs = len(outputs)
        segment_of_node: dict[fx.Node, int] = {p: 0 for p in placeholders}
        for s in range(len(bounds) - 1):
            for n in body[bounds[s]:bounds[s + 1]]:
                segment_of_node[n] = s
        self.n_segments = len(bounds) - 1
        # Output position -> the segment that returns it (None gradients and placeholders: segment 0).
        of_output = [segment_of_node[g] if isinstance(g, fx.Node) else 0 for g in outputs]
        self.positions = [[i for i, s in enumerate(of_output) if s == k] for k in range(self.n_segments)]
        self.made = {i for i, g in enumerate(outputs) if isinstance(g, fx.Node)}  # inputs that get a gradient
        last_use = dict.fromkeys(segment_of_node, -1)
        for n in body:
            for a in n.all_input_nodes:
                last_use[a] = max(last_use[a], segment_of_node[n])
        order = {n: i for i, n in enumerate([*placeholders, *body])}
        self.programs: list[Callable] = []
        carry_in: list[fx.Node] = placeholders
        for s in range(self.n_segments):
            carry_out = sorted((n for n in order if segment_of_node[n] <= s < last_use[n]), key=order.__getitem__)
            self.programs.append(_segment_program(gm, carry_in, body[bounds[s]:bounds[s + 1]],
                                                  [outputs[i] for i in self.positions[s]], carry_out))
            carry_in = carry_out

    def run(self, s: int, args: list) -> tuple[tuple, list]:
        """Segment ``s`` on ``args`` (cleared): its gradients (``positions[s]``) and the values it carries on."""
        out = self.programs[s](args)
        k = len(self.positions[s])
        return tuple(out[:k]), list(out[k:])

    def place(self, grads: list, s: int, made: tuple) -> None:
        """Put segment ``s``'s gradients at their input positions in ``grads``."""
        for pos, g in zip(self.positions[s], made):
            grads[pos] = g

    def run_whole(self, args: list) -> tuple:
        grads: list = [None] * self.n_outputs
        carry = args
        for s in range(self.n_segments):
            made, carry = self.run(s, carry)
            self.place(grads, s, made)
        return tuple(grads)


def _segment_program(gm: fx.GraphModule, inputs: list[fx.Node], nodes: list[fx.Node], grads: list,
                     carry_out: list[fx.Node]) -> Callable:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        new = graph.placeholder(n.name)
        new.meta = dict(n.meta)
        env[n] = new
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[g] if isinstance(g, fx.Node) else g for g in grads) + tuple(env[n] for n in carry_out))
    graph.set_codegen(BoxedCodeGen())  # each value freed after its last use, the argument list cleared
    return lazy_graph_module(gm, graph)  # a split replaced after the first run never generates code


class SegmentedBackward:
    """A boxed backward program (AOTAutograd's calling convention), split into segment programs.

    Called by AOTAutograd with (saved values + tangents): runs segment 0 only when a wired call's
    pre-hook announced it (the rest runs in that call's :class:`_ReleaseSegment` nodes), else every
    segment in turn, returning all gradients as the one program did.  The first whole run is timed
    and sets how many segments later calls get: about one per :data:`MS_PER_SEGMENT` of backward,
    so the release nodes' own cost (~0.15 ms each on CPU) stays near 1% of the backward.
    """

    _boxed_call = True  # AOTAutograd passes the argument list itself, which each program clears as it reads
    takes_unreached = True  # told which gradients no tangent reached (:class:`FilledTangents`)

    def __init__(self, gm: fx.GraphModule, max_segments: int = MAX_SEGMENTS):
        self.gm = gm
        self.max_segments = max_segments
        self.split = _Split(gm, max_segments)
        self.timed = max_segments < 2

    @property
    def n_segments(self) -> int:
        return self.split.n_segments

    def __call__(self, args: list, unreached: frozenset[int] = frozenset()) -> tuple:
        """``unreached``: gradients that read only missing tangents, None however a segment returns them (NOTE
        [gradients no tangent reaches]); the caller sets those a whole run returns."""
        call = getattr(_current, "call", None)
        _current.call = None
        if call is not None and call.backward is self:
            split = call.split
            grads: list = [None] * split.n_outputs
            made, call.carry = split.run(0, args)
            call.next_segment, call.autocast, call.unreached = 1, any_autocast_enabled(), unreached
            split.place(grads, 0, made)
            return tuple(grads)
        if self.timed:  # a call that was not wired (nothing to release early)
            return self.split.run_whole(args)
        t0 = time.perf_counter()
        out = self.split.run_whole(args)
        ms = (time.perf_counter() - t0) * 1e3
        self.timed = True
        wanted = max(1, min(self.max_segments, int(ms / MS_PER_SEGMENT)))
        if wanted < self.split.n_segments:  # calls wired before keep the split they were wired with
            self.split = _Split(self.gm, wanted)
        return out

    def run_later(self, call: _Call, s: int) -> tuple:
        """Segment ``s`` of ``call``'s backward (from its :class:`_ReleaseSegment` node)."""
        if call.carry is None or call.next_segment != s:
            raise SegmentError(
                f"remat_plugin.execute: the planned backward reached segment {s} of {call.split.n_segments} before "
                f"segment {s - 1} ran (the autograd engine ran this step's nodes out of order). Report this with your "
                "model; RematConfig(...) cannot work around it")
        carry, call.carry = call.carry, None
        with nullcontext() if call.autocast else autocast_disabled():
            made, call.carry = call.split.run(s, carry)
        call.next_segment = s + 1
        if s == call.split.n_segments - 1:
            call.carry = None
        return made

    # --- wiring one call ---------------------------------------------------------------------
    def wire(self, inputs: Sequence) -> tuple[list, _Call | None]:
        """``inputs`` rerouted through a release chain for one call, and its :class:`_Call`; or as they are and None
        when there is nothing to release early (then the backward runs whole)."""
        inputs = list(inputs)
        split = self.split
        if split.n_segments < 2 or len(inputs) != split.n_outputs:
            return inputs, None
        wants = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
        differentiable = [id(t) for t, w in zip(inputs, wants) if w]
        if len(set(differentiable)) != len(differentiable):  # one tensor passed twice: its gradient has two parts
            return inputs, None
        # The anchor's gradient starts the chain: one segment 0 makes (an unused parameter's None would reach its
        # Link node as zeros, and ``.grad`` would get them).
        anchor = next((i for i in split.positions[0] if wants[i] and i in split.made), None)
        # Per later segment: (place among its gradients, input position) of the inputs that want theirs.
        later = {s: [(k, i) for k, i in enumerate(split.positions[s]) if wants[i]] for s in range(1, split.n_segments)}
        if anchor is None or not any(later.values()):
            return inputs, None
        call = _Call(self, split)
        token = None
        for s in range(split.n_segments - 1, 0, -1):
            token = _ReleaseSegment.apply(call, s, [k for k, _ in later[s]], token, *(inputs[i] for _, i in later[s]))
            for _, i in later[s]:
                inputs[i] = inputs[i].detach()
        inputs[anchor] = _Link.apply(inputs[anchor], token)
        return inputs, call

    @staticmethod
    def attach(call: _Call, outputs: Sequence) -> None:
        """Announce ``call`` to its AOTAutograd node's backward (which the outputs' autograd graph leads to)."""
        node = compiled_node(outputs)
        if node is None:
            raise SegmentError(
                "remat_plugin.execute: could not find the planned step's autograd node among its outputs' gradient "
                "functions; its gradients would be lost. Report this with your torch version")
        node.register_prehook(lambda _grads: setattr(_current, "call", call))


def ordered_first_call(inputs: Sequence) -> list:
    """``inputs`` for a step's first call (which traces), each differentiable one behind its own identity node.

    NOTE [first call order]
    DDP orders its buckets, once, by the order gradients became ready in the first backward, and
    AOTAutograd's one node hands every gradient to autograd at once, in no set order.  The autograd
    engine runs ready nodes latest-created first, so identity nodes created in input order hand the
    gradients on in reverse input order: the last parameters first, DDP's own initial order and the
    order the segmented backward releases them in when layers are registered in forward order.  The
    inputs still require grad (AOTAutograd traces the gradients of those that do).
    """
    return [_InOrder.apply(t) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in inputs]


def compiled_node(outputs: Sequence):
    """AOTAutograd's ``CompiledFunctionBackward`` node behind the step's outputs (views may sit in between)."""
    frontier = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for _ in range(4):
        for fn in frontier:
            if type(fn).__name__ == "CompiledFunctionBackward":
                return fn
        frontier = [nxt for fn in frontier for nxt, _ in fn.next_functions if nxt is not None]
    return None


class _ReleaseSegment(torch.autograd.Function):
    """Forward: a token.  Backward: segment ``s`` of the call's backward; its inputs' gradients, final here."""

    @staticmethod
    def forward(ctx, call: _Call, s: int, index: list[int], token, *tensors):  # type: ignore[override]
        ctx.call, ctx.s, ctx.index, ctx.has_token = call, s, index, token is not None
        return torch.empty(0)

    @staticmethod
    def backward(ctx, _token_grad):  # type: ignore[override]
        call = ctx.call
        made = call.backward.run_later(call, ctx.s)
        positions = call.split.positions[ctx.s]
        return (None, None, None, torch.empty(0) if ctx.has_token else None,
                *(None if positions[k] in call.unreached else made[k] for k in ctx.index))


class _InOrder(torch.autograd.Function):
    """Identity; its node's place in the engine's order is what counts (NOTE [first call order])."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # a gradient no tangent reached stays None (NOTE [gradients no tangent reaches])
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad


class _Link(torch.autograd.Function):
    """The anchor input on its way into AOTAutograd's node; backward passes its gradient on and starts the chain."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, token: torch.Tensor):  # type: ignore[override]
        ctx.set_materialize_grads(False)  # an anchor no tangent reached stays None; the chain starts all the same
        return anchor.detach()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, torch.empty(0)
