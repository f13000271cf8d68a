"""Cut the forward graph into a chain of blocks at 1-separators (Rockmate A.4).

A cut after forward op ``i`` is allowed when exactly one value made at or before
``i`` is still read by a later forward op: that value is the chain activation x.
Values that depend on no input (attention masks, position ranges) are made once and
read by every layer; they would glue the model into one block, so they are treated
like parameters here (alive throughout, never recomputed by a block).  Residual adds
need no special case: after the add only the new hidden state crosses the cut.

Backward ops join the block whose forward values they read (the earliest one, since
backward runs blocks in reverse), so each block's forward+backward is a small
:class:`Problem` of its own; identical blocks are recognised by a canonical key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from remat_plugin.ir.problem import Op, Problem, Schedule
from remat_plugin.ir.simulate import simulate


@dataclass(frozen=True)
class Block:
    index: int
    fwd_ops: tuple[str, ...]
    bwd_ops: tuple[str, ...]
    input_value: str | None  # x_i (None for the first block)
    output_value: str | None  # x_{i+1} (None for the last block)
    problem: Problem  # the block alone: values from outside are external
    key: tuple  # equal keys = identical blocks (solved once)


def _cut_positions(
    problem: Problem, constants: set[str], min_fwd_ops: int
) -> tuple[list[tuple[int, str]], list[Op]]:
    """Cut points (forward position, chain value x) and the forward ops they index."""
    fwd = [o for o in problem.fwd_ops if o.name not in constants]
    pos = {o.name: i for i, o in enumerate(fwd)}
    made_at = {v: pos[o.name] for o in fwd for v in o.outputs}
    last_read: dict[str, int] = {}
    for o in fwd:
        for v in o.inputs:
            if v in made_at:
                last_read[v] = pos[o.name]
    n = len(fwd)
    crossing: list[set[str]] = [set() for _ in range(n)]
    for v, r in last_read.items():
        for i in range(made_at[v], r):
            crossing[i].add(v)
    cuts: list[tuple[int, str]] = []
    last_cut = -1
    for i in range(n - 1):
        if len(crossing[i]) == 1 and fwd[i + 1].recomputable and i - last_cut >= min_fwd_ops:
            cuts.append((i, next(iter(crossing[i]))))
            last_cut = i
    if cuts and n - 1 - cuts[-1][0] < min_fwd_ops:
        cuts.pop()
    return cuts, fwd


def make_blocks(problem: Problem, constants: set[str], min_fwd_ops: int = 2) -> list[Block]:
    """The chain of blocks of ``problem``; ``constants`` are ops that depend on no input."""
    cuts, fwd = _cut_positions(problem, constants, min_fwd_ops)
    # rng-capture ops have no inputs and sit just before their random op: same block as it
    block_of_op: dict[str, int] = {}
    b = 0
    cut_iter = iter(cuts)
    next_cut = next(cut_iter, None)
    for i, o in enumerate(fwd):
        block_of_op[o.name] = b
        if next_cut is not None and i == next_cut[0]:
            b += 1
            next_cut = next(cut_iter, None)
    n_blocks = b + 1
    xs: list[str | None] = [None, *(v for _, v in cuts), None]
    value_block = {v: block_of_op[o.name] for o in fwd for v in o.outputs}
    bwd_group = _group_backward(problem, value_block, n_blocks)
    blocks = []
    for k in range(n_blocks):
        f = tuple(o.name for o in fwd if block_of_op[o.name] == k)
        g = tuple(o.name for o in problem.bwd_ops if bwd_group[o.name] == k)
        sub = _subproblem(problem, set(f) | set(g), exclude_live={xs[k + 1]})
        blocks.append(Block(k, f, g, xs[k], xs[k + 1], sub, _canonical_key(sub)))
    return blocks


def _group_backward(problem: Problem, value_block: dict[str, int], n_blocks: int) -> dict[str, int]:
    group: dict[str, int] = {}
    producer = {v: o.name for o in problem.ops for v in o.outputs}
    pending = []
    for o in problem.bwd_ops:
        ks = [value_block[v] for v in o.inputs if v in value_block]
        ks += [group[producer[v]] for v in o.inputs if v not in value_block and producer.get(v) in group]
        if ks:
            group[o.name] = min(ks)
        else:
            pending.append(o)
    readers: dict[str, list[str]] = {}
    for o in problem.bwd_ops:
        for v in o.inputs:
            readers.setdefault(v, []).append(o.name)
    for o in reversed(pending):  # no inputs: run with its first consumer
        ks = [group[r] for v in o.outputs for r in readers.get(v, []) if r in group]
        group[o.name] = max(ks) if ks else n_blocks - 1
    # a reader grouped before its no-input producer was placed must not run before it
    for o in problem.bwd_ops:
        for v in o.inputs:
            p = producer.get(v)
            if p in group and not problem.op(p).is_fwd and group[p] < group[o.name]:
                group[o.name] = group[p]
    return group


def _subproblem(problem: Problem, names: set[str], exclude_live: set) -> Problem:
    """The ops ``names`` alone; ``exclude_live`` (the chain output x) is the chain's to keep or free."""
    ops = [o for o in problem.ops if o.name in names]
    inside = {v for o in ops for v in o.outputs}
    read_outside = {v for o in problem.ops if o.name not in names for v in o.inputs}
    new_ops = tuple(
        Op(o.name, o.is_fwd, tuple(v for v in o.inputs if v in inside), o.outputs, o.time_ms, o.temp_bytes, o.recomputable)
        for o in ops
    )
    values = tuple(problem.value(v) for v in inside)
    live_out = frozenset(
        v for v in inside if v in problem.live_out or (v in read_outside and v not in exclude_live)
    )
    return Problem(new_ops, values, live_out)


def _canonical_key(problem: Problem) -> tuple:
    index = {}
    for i, o in enumerate(problem.ops):
        for j, v in enumerate(o.outputs):
            index[v] = (i, j)
    return tuple(
        (
            re.sub(r"_\d+", "", o.name),  # fx names ops after their target: "addmm_3" is an addmm
            o.is_fwd,
            o.recomputable,
            round(o.time_ms, 6),
            o.temp_bytes,
            tuple(index[v] for v in o.inputs),
            tuple((problem.value(v).size_bytes, v in problem.live_out) for v in o.outputs),
        )
        for o in problem.ops
    )


def rename_schedule(schedule: Schedule, source: Problem, target: Problem) -> Schedule:
    """Map a schedule solved on ``source`` onto the identical block ``target`` (ops matched by position)."""
    mapping = {a.name: b.name for a, b in zip(source.ops, target.ops)}
    return Schedule(tuple(mapping[n] for n in schedule.bwd_sequence))


def forward_only_peak(problem: Problem, output_value: str | None) -> int:
    """Peak of the block's forward keeping nothing but its output."""
    fwd_ops = tuple(o for o in problem.ops if o.is_fwd)
    made = {v for o in fwd_ops for v in o.outputs}
    live = frozenset({output_value} & made) if output_value else frozenset(problem.live_out & made)
    sub = Problem(fwd_ops, tuple(problem.value(v) for v in made), live)
    return simulate(sub, Schedule(())).peak_bytes
