"""Compiled execution: our planned forward and backward programs, run as inductor kernels.

NOTE [compiled programs]
    With ``compile=True`` each program the executor emits (:mod:`remat_plugin.capture.programs`)
    is cut, in program order, into segments: maximal runs of deterministic aten ops, and the ops
    between them (random ops and their RNG capture/replay, which must draw from the caller's
    generator as eager does).  Each run is compiled by inductor as a graph of its own
    (``compile_fx_inner``: no AOTAutograd, no partitioner), so inductor fuses kernels inside a
    segment but cannot move a value across segments, re-partition, or undo a recomputation: what
    is kept and what is recomputed stays our schedule's.

    A segment receives its inputs in a list it clears (inductor's boxed convention); an input
    read for the last time by that segment is handed over, not kept by the runner, so inductor
    frees it at its own last use, as the eager program frees values after their last use.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from remat_plugin.errors import RematError
from remat_plugin.torch_private import OpOverload, compile_segment


def _compilable(node: fx.Node) -> bool:
    """Deterministic aten ops (and getitems of them): random ops stay eager, on the caller's generator."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    return isinstance(node.target, OpOverload) and torch.Tag.nondeterministic_seeded not in node.target.tags


def _computes(node: fx.Node) -> bool:
    """Whether a node does work worth a kernel (not a view, getitem or metadata op)."""
    if node.target is operator.getitem or not isinstance(node.target, OpOverload):
        return False
    return not any(isinstance(r.type, torch.TensorType) and r.alias_info is not None
                   for r in node.target._schema.returns)


@dataclass
class _Segment:
    inputs: list[str]
    outputs: list[str]
    run: Callable[[list], Any]  # boxed: receives the input list and may clear it
    release: list[bool]  # per input: its last read is here (the runner hands it over)
    compiled: bool  # run is inductor's kernel (else eager ops)


class SegmentedProgram:
    """One fx program as compiled segments and eager ops; called with AOTAutograd's boxed convention."""

    _boxed_call = True

    def __init__(self, placeholders: list[str], segments: list[_Segment], output: Any):
        self.placeholders = placeholders
        self.segments = segments
        self.output = output  # the output node's argument, fx.Node leaves replaced by names
        self.n_compiled = sum(s.compiled for s in segments)

    def __call__(self, args: list) -> Any:
        env = dict(zip(self.placeholders, args))
        args.clear()
        for seg in self.segments:
            ins = [env.pop(name) if last else env[name] for name, last in zip(seg.inputs, seg.release)]
            outs = seg.run(ins)
            del ins
            for name, value in zip(seg.outputs, outs):
                env[name] = value
        return fx.node.map_aggregate(self.output, lambda a: env[a] if isinstance(a, _Name) else a)


class _Name(str):
    """A value's name inside the program's output structure."""


class _Eager:
    """One op run as is (a random op, an RNG capture or replay, a view between segments)."""

    def __init__(self, node: fx.Node, inputs: list[str]):
        self.target = node.target
        self.args, self.kwargs = node.args, node.kwargs
        self.inputs = inputs

    def __call__(self, ins: list) -> Any:
        values = dict(zip(self.inputs, ins))
        ins.clear()
        args, kwargs = fx.node.map_arg((self.args, self.kwargs), lambda a: values[a.name])
        values.clear()  # the op's arguments hold them now, and no longer than the op
        return (self.target(*args, **kwargs),)  # type: ignore[operator]


def compile_program(gm: fx.GraphModule) -> SegmentedProgram:
    """``gm`` (a planned forward or backward program) as inductor segments and eager ops (NOTE [compiled programs])."""
    nodes = list(gm.graph.nodes)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    output_node = next(n for n in nodes if n.op == "output")
    body = _getitems_after_producers([n for n in nodes if n.op not in ("placeholder", "output")])

    runs: list[list[fx.Node]] = []
    open_run: list[fx.Node] | None = None  # the run compiled nodes join
    for node in body:
        compiled = _compilable(node)
        if compiled and node.target is operator.getitem:  # a segment's inputs are tensors, never a tuple
            compiled = open_run is not None and node.args[0] in open_run  # type: ignore[operator]
        if compiled and open_run is not None:
            open_run.append(node)
        else:
            runs.append([node])
            open_run = runs[-1] if compiled else None

    last_read: dict[str, int] = {}
    for i, run in enumerate(runs):
        for n in run:
            for a in n.all_input_nodes:
                last_read[a.name] = i
    for a in output_node.all_input_nodes:
        last_read[a.name] = len(runs)

    segments = []
    for i, run in enumerate(runs):
        inside = {n.name for n in run}
        inputs: list[str] = []
        for n in run:
            for a in n.all_input_nodes:
                if a.name not in inside and a.name not in inputs:
                    inputs.append(a.name)
        outputs = [n.name for n in run if last_read.get(n.name, -1) > i]
        release = [last_read[name] == i for name in inputs]
        kernel = False
        if len(run) == 1 and (not _compilable(run[0]) or run[0].target is operator.getitem):  # eager
            seg_run: Callable[[list], Any] = _Eager(run[0], inputs)
            outputs = [run[0].name]
        elif any(_computes(n) for n in run):
            seg_run, kernel = _compiled(_subgraph(gm, run, inputs, outputs)), True
        else:
            seg_run = _EagerGraph(_subgraph(gm, run, inputs, outputs))
        segments.append(_Segment(inputs, outputs, seg_run, release, kernel))
    output = fx.node.map_arg(output_node.args[0], lambda a: _Name(a.name))
    return SegmentedProgram(placeholders, segments, output)


def _compiled(segment: fx.GraphModule) -> Callable[[list], Any]:
    try:
        return compile_segment(segment)
    except Exception as exc:  # inductor raises many types; each means this segment did not compile
        ops = sorted({str(n.target) for n in segment.graph.nodes if n.op == "call_function"})
        raise RematError(f"remat_plugin: inductor could not compile a segment of the planned step (ops: "
                         f"{', '.join(ops[:8])}{', ...' if len(ops) > 8 else ''}): {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:300] if str(exc) else ''}. Plan without compile=True "
                         "(REMAT_COMPILE=0) to run it eagerly") from exc


def _getitems_after_producers(body: list[fx.Node]) -> list[fx.Node]:
    """``body`` with each getitem moved up to just after the op it reads: a segment's outputs are then its
    tensors, never a multi-output op's tuple (the executor derives some getitems of views late, at first use)."""
    index = {n: i for i, n in enumerate(body)}
    order: list[fx.Node] = []
    for node in body:
        if node.target is operator.getitem and node.args[0] in index:
            continue  # placed with its producer
        order.append(node)
        order.extend(sorted((u for u in node.users if u.target is operator.getitem and u in index),
                            key=index.__getitem__))
    return order


class _EagerGraph:
    """A run of views and getitems: not worth a kernel."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm

    def __call__(self, ins: list) -> Any:
        out = self.gm(*ins)
        ins.clear()
        return out


def _subgraph(gm: fx.GraphModule, run: list[fx.Node], inputs: list[str], outputs: list[str]) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in inputs:
        ph = graph.placeholder(name)
        ph.meta = dict(by_name[name].meta)
        env[name] = ph
    for n in run:
        env[n.name] = graph.node_copy(n, lambda a: env[a.name])
    graph.output(tuple(env[name] for name in outputs))
    return fx.GraphModule(gm, graph)
