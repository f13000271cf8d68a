"""Cut the forward graph into a chain of blocks at 1-separators (Rockmate A.4), with side values.

A cut after forward op ``i`` is allowed when exactly one value made at or before ``i``
is still read by a later forward op: that value is the chain activation x.  Residual
adds need no special case: after the add only the new hidden state crosses the cut.

NOTE [side values]
    Some values are read by every layer: attention masks, rotary tables, T5's position
    bias, an encoder output read by each cross-attention, a U-Net's long skips.  Counted
    as crossing, they leave no 1-separator and glue the model into one block.

    - Constants: forward ops that do not mix a user input with a trainable tensor (rotary
      tables from the ``inv_freq`` buffer, masks from ``attention_mask``, position ranges)
      are made once in the forward and belong to no block, unless only one block reads
      them: then they join it and can be freed and recomputed there.
    - Side values: when the plain 1-separators still leave a block with more than
      :data:`GLUED_SHARE` of the forward ops, some values are left out of the cut search.
      Two candidate sets, each kept only if it gives more cuts: the values that outlive all
      others (the top of the largest gap in the sorted lifetimes, at least
      :data:`SIDE_MIN_SPAN` ops and :data:`SIDE_GAP` times the next), and the small
      long-lived values (at least :data:`SIDE_MIN_SPAN` ops, at most
      :data:`SIDE_SMALL_SHARE` of the median such value's bytes: each mixture-of-experts layer's
      router logits, read by the load-balancing loss at the end, whose lifetimes fall off
      evenly, with no gap above the layers' own values).  Of the sets that leave no block
      above :data:`GLUED_SHARE`, the one holding the fewest bytes is taken (the gap rule
      alone made a 4-layer Mixtral one greedy block, or, at other sizes, made its residual
      streams side values, never recomputed); if none does, the one with more cuts.  (In a
      model that is already cut into layers, the longest values are the residual streams,
      which the chain should keep choosing to store or recompute.)
      A side value stays with the block that makes it (alive to that block's end) and is
      an external input of the blocks that read it.
    - Both are charged to the memory of every block they are alive across
      (:attr:`Block.side_bytes`), so the chain DP counts them.

Backward ops join the block whose forward values they read (the earliest one, since
backward runs blocks in reverse), so each block's forward+backward is a small
:class:`Problem` of its own; identical blocks are recognised by a canonical key.
"""
from __future__ import annotations

import itertools
import re
from collections import Counter
from dataclasses import dataclass

from remat_plugin.ir.problem import Incoming, Op, Problem, Schedule
from remat_plugin.ir.simulate import simulate

SIDE_MIN_SPAN = 16  # forward ops a side value must stay alive across
SIDE_GAP = 2.0  # a side value outlives every non-side value by at least this factor
SIDE_SMALL_SHARE = 1 / 8  # or it is this small beside the median long-lived value
GLUED_SHARE = 0.4  # a block holding more of the forward ops than this is glued: look for side values


@dataclass(frozen=True)
class Block:
    index: int
    fwd_ops: tuple[str, ...]
    bwd_ops: tuple[str, ...]
    input_value: str | None  # x_i (None for the first block)
    output_value: str | None  # x_{i+1} (None for the last block)
    problem: Problem  # the block alone: values from outside are external
    key: tuple  # (structure_key, costs): equal keys = identical blocks (solved once)
    side_bytes: int = 0  # bytes made outside the block (side values, constants, skipping gradients) alive meanwhile

    @property
    def structure(self) -> tuple:
        """The block's :func:`structure_key` (the first part of its key)."""
        return self.key[0]


@dataclass(frozen=True)
class _Lifetimes:
    """Forward ops outside the constants, in order, and when each value they make is made and last read."""

    fwd: list[Op]
    made_at: dict[str, int]
    last_read: dict[str, int]
    size: dict[str, int]  # bytes of each value made

    @staticmethod
    def of(problem: Problem, constants: set[str]) -> _Lifetimes:
        fwd = [o for o in problem.fwd_ops if o.name not in constants]
        made_at = {v: i for i, o in enumerate(fwd) for v in o.outputs}
        last_read: dict[str, int] = {}
        for i, o in enumerate(fwd):
            for v in o.inputs:
                if v in made_at:
                    last_read[v] = i
        return _Lifetimes(fwd, made_at, last_read, {v: problem.value(v).size_bytes for v in made_at})

    def crossing(self, skip: frozenset[str] = frozenset()) -> list[set[str]]:
        """Per position ``i``: values made at or before ``i`` and read after it (``skip`` left out)."""
        out: list[set[str]] = [set() for _ in self.fwd]
        for v, r in self.last_read.items():
            if v not in skip:
                for i in range(self.made_at[v], r):
                    out[i].add(v)
        return out


def side_values(problem: Problem, constants: set[str]) -> frozenset[str]:
    """The values left out when looking for cuts; see NOTE [side values]."""
    return _side_values(_Lifetimes.of(problem, constants))


def _side_values(life: _Lifetimes) -> frozenset[str]:
    n = len(life.fwd)
    plain = _cuts(life, frozenset(), 2)
    if _largest_block(plain, n) <= GLUED_SHARE * n:
        return frozenset()  # the plain 1-separators already cut the model into layers
    candidates = (_small_side_values(life), _longest_side_values(life))
    found = {side: cuts for side in candidates if side and len(cuts := _cuts(life, side, 2)) > len(plain)}
    ungluing = [side for side, cuts in found.items() if _largest_block(cuts, n) <= GLUED_SHARE * n]
    if ungluing:  # the fewest bytes held out of the chain
        return min(ungluing, key=lambda side: sum(life.size[v] for v in side))
    return max(found, key=lambda side: len(found[side]), default=frozenset())


def _small_side_values(life: _Lifetimes) -> frozenset[str]:
    """Values alive across at least :data:`SIDE_MIN_SPAN` ops and at most :data:`SIDE_SMALL_SHARE` of the median
    bytes of such values (a router's logits, kept by every mixture-of-experts layer for the load-balancing loss at
    the end, beside the residual streams)."""
    long_lived = [v for v, r in life.last_read.items() if r - life.made_at[v] >= SIDE_MIN_SPAN]
    if not long_lived:
        return frozenset()
    small = SIDE_SMALL_SHARE * sorted(life.size[v] for v in long_lived)[len(long_lived) // 2]
    return frozenset(v for v in long_lived if life.size[v] <= small)


def _longest_side_values(life: _Lifetimes) -> frozenset[str]:
    """The values that outlive all others (the top of the largest gap in the sorted lifetimes)."""
    spans = sorted(((r - life.made_at[v], v) for v, r in life.last_read.items()), reverse=True)
    best_k, best_gap = 0, SIDE_GAP
    for k in range(1, len(spans) + 1):
        if spans[k - 1][0] < SIDE_MIN_SPAN:
            break
        below = spans[k][0] if k < len(spans) else 0
        gap = spans[k - 1][0] / max(below, 1)
        if gap >= best_gap:
            best_k, best_gap = k, gap
    return frozenset(v for _, v in spans[:best_k])


def _largest_block(cuts: list[tuple[int, str]], n: int) -> int:
    bounds = [-1, *(i for i, _ in cuts), n - 1]
    return max(b - a for a, b in itertools.pairwise(bounds))


def _cuts(life: _Lifetimes, side: frozenset[str], min_fwd_ops: int) -> list[tuple[int, str]]:
    """Cut points (forward position, chain value x)."""
    crossing = life.crossing(side)
    fwd, n = life.fwd, len(life.fwd)
    cuts: list[tuple[int, str]] = []
    last_cut = -1
    for i in range(n - 1):
        if len(crossing[i]) == 1 and fwd[i + 1].recomputable and i - last_cut >= min_fwd_ops:
            cuts.append((i, next(iter(crossing[i]))))
            last_cut = i
    if cuts and n - 1 - cuts[-1][0] < min_fwd_ops:
        cuts.pop()
    return cuts


def make_blocks(problem: Problem, constants: set[str], min_fwd_ops: int = 2) -> list[Block]:
    """The chain of blocks of ``problem``; ``constants`` are the forward ops of ``JointGraph.constant_ops``."""
    life = _Lifetimes.of(problem, constants)
    side = _side_values(life)
    cuts, fwd = _cuts(life, side, min_fwd_ops), life.fwd
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
    value_block = {v: block_of_op[o.name] for o in fwd for v in o.outputs if v not in side}
    bwd_group = _group_backward(problem, value_block, n_blocks)
    if _localise_constants(problem, constants, block_of_op, bwd_group):
        value_block = {v: block_of_op[o.name] for o in problem.fwd_ops if o.name in block_of_op
                       for v in o.outputs if v not in side}
        bwd_group = _group_backward(problem, value_block, n_blocks)
    charges = _side_charges(problem, {**block_of_op, **bwd_group}, {x for x in xs if x}, n_blocks)
    blocks = []
    for k in range(n_blocks):
        f = tuple(o.name for o in problem.fwd_ops if block_of_op.get(o.name) == k)
        g = tuple(o.name for o in problem.bwd_ops if bwd_group[o.name] == k)
        sub = _subproblem(problem, set(f) | set(g), exclude_live={xs[k + 1]})
        blocks.append(Block(k, f, g, xs[k], xs[k + 1], sub, _canonical_key(sub), charges[k]))
    return blocks


def _localise_constants(problem: Problem, constants: set[str], block_of_op: dict[str, int],
                        bwd_group: dict[str, int]) -> bool:
    """Move each constant read by one block only into that block, where it can be freed and recomputed.

    (GPT-2 without a mask builds each layer's float mask from a shared causal table: only the
    table stays a constant.)  ``block_of_op`` gains the moved ops; returns whether any moved.
    """
    readers: dict[str, list[str]] = {}
    for o in problem.ops:
        for v in o.inputs:
            readers.setdefault(v, []).append(o.name)
    moved = False
    for o in reversed(problem.fwd_ops):  # readers first, so a chain of constants moves together
        if o.name not in constants or not o.recomputable:
            continue
        found = {block_of_op.get(r, bwd_group.get(r, -1)) for v in o.outputs for r in readers.get(v, ())}
        if len(found) == 1 and -1 not in found:
            block_of_op[o.name] = next(iter(found))
            moved = True
    return moved


def _side_charges(problem: Problem, block_of: dict[str, int], chain_values: set[str], n_blocks: int) -> list[int]:
    """Per block, the bytes of values made elsewhere that are alive while it runs (NOTE [side values]).

    A forward value (or a constant, made just before its first reader) read by another block is
    alive from the block that makes it to the end of the chain and back down to its lowest reader.  A backward value that skips over
    blocks (the gradient of a side value) is alive in the blocks between its maker and its reader.  A
    forward output the caller gets (``live_out``) is alive from its forward to the end of the step: it is
    charged to every other block (during the forward of the blocks before its maker too, which is safe).
    Chain values, their gradients (read by the adjacent block) and parameter gradients are the DP's own.
    """
    charges = [0] * n_blocks
    readers: dict[str, set[int]] = {}
    for o in problem.ops:
        for v in o.inputs:
            if o.name in block_of:  # constants read by constants are charged where those are read
                readers.setdefault(v, set()).add(block_of[o.name])
    for value in problem.values:
        v = value.name
        if v in problem.live_out and v not in chain_values and problem.op(value.producer).is_fwd:
            for k in range(n_blocks):  # a forward output the caller gets: alive from its forward to the end
                if k != block_of.get(value.producer):
                    charges[k] += value.size_bytes
            continue
        if v in chain_values or v in problem.live_out or v not in readers:
            continue
        op = problem.op(value.producer)
        if op.name not in block_of:  # a constant: made in the forward just before its first reader
            made, read = min(readers[v]) - 1, readers[v]
        else:
            made, read = block_of[op.name], readers[v] - {block_of[op.name]}
        if not read:
            continue
        if op.is_fwd:
            span = range(min(made + 1, min(read)), n_blocks)
        elif made - min(read) >= 2:
            span = range(min(read) + 1, made)
        else:
            continue
        for k in span:
            if k != made:
                charges[k] += value.size_bytes
    return charges


def glued_values(problem: Problem, constants: set[str], blocks: list[Block], top: int = 4) -> list[str]:
    """The values alive across most of a block that holds more than :data:`GLUED_SHARE` of the forward
    ops (named with the forward positions they live between), or [] when no block is that big."""
    life = _Lifetimes.of(problem, constants)
    n = len(life.fwd)

    def size(b: Block) -> int:  # counted as make_blocks counts: constants a block took in are not what glues it
        return sum(o not in constants for o in b.fwd_ops)

    biggest = max(blocks, key=size)
    if n < 20 or size(biggest) <= GLUED_SHARE * n:
        return []
    inside = set(biggest.fwd_ops)
    crossing = [c for o, c in zip(life.fwd, life.crossing(_side_values(life))) if o.name in inside]
    counts = Counter(v for c in crossing for v in c)
    return [f"{v} (made by op {life.made_at[v]}, read until op {life.last_read[v]})" for v, _ in counts.most_common(top)]


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


# NOTE [incoming gradients]
#     A block's backward reads gradients that later blocks' backwards made: δ_{i+1}, the gradient of its
#     output; the gradient that the next layer's weight-gradient op reads (the op is grouped here, as it
#     also reads this block's output); the gradients of side values this block made.  Each dies at its
#     last read here, so a schedule that recomputes after those reads holds less: on mlp-chain (float64)
#     that lowers the floor by one activation (1 MiB, 5%).  Left out of the block problem, such a schedule
#     looked no lower and was slower, the Pareto menu dropped it, and whether it survived hung on measured
#     op times.  So the block problem carries them (``Problem.incoming``): the simulator and the block ILP
#     count each from the backward's start to its last reader, and the chain DP, which counts δ_{i+1}
#     alive through the whole backward action, takes its size off the option's backward peak
#     (``Planner._chain_block``).
def _subproblem(problem: Problem, names: set[str], exclude_live: set) -> Problem:
    """The ops ``names`` alone; ``exclude_live`` (the chain output x) is the chain's to keep or free; the
    gradients its backward reads from later blocks are its ``incoming`` (NOTE [incoming gradients])."""
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
    readers: dict[str, list[str]] = {}
    for o in ops:
        for v in o.inputs:
            if not o.is_fwd and v not in inside and not problem.op(problem.value(v).producer).is_fwd:
                readers.setdefault(v, []).append(o.name)
    incoming = tuple(Incoming(v, problem.value(v).size_bytes, tuple(r)) for v, r in readers.items()
                     if problem.value(v).size_bytes)  # (an empty one would only tell blocks apart)
    return Problem(new_ops, values, live_out, incoming=incoming)


def structure_key(problem: Problem) -> tuple:
    """What a block's schedules depend on, without its costs or sizes: blocks with equal structure keys
    take each other's schedules (:func:`rename_schedule`), at other batch sizes or sequence lengths too."""
    index = {}
    for i, o in enumerate(problem.ops):
        for j, v in enumerate(o.outputs):
            index[v] = (i, j)
    position = {o.name: i for i, o in enumerate(problem.ops)}
    return tuple(
        (
            re.sub(r"_\d+", "", o.name),  # fx names ops after their target: "addmm_3" is an addmm
            o.is_fwd,
            o.recomputable,
            tuple(index[v] for v in o.inputs),
            tuple(v in problem.live_out for v in o.outputs),
        )
        for o in problem.ops
    ) + tuple(("incoming", tuple(position[r] for r in g.readers)) for g in problem.incoming)


def _canonical_key(problem: Problem) -> tuple:
    """The structure and every cost: blocks with equal keys are identical (one menu serves both)."""
    costs = tuple(
        (round(o.time_ms, 6), o.temp_bytes, tuple(problem.value(v).size_bytes for v in o.outputs))
        for o in problem.ops
    ) + tuple(g.size_bytes for g in problem.incoming)
    return structure_key(problem), costs


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
