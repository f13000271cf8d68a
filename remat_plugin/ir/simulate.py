"""The one simulator: memory timeline and time of a schedule (the spec all solvers answer to).

Memory is counted in bytes above what is alive when the step starts (parameters and
inputs are outside the problem).  While an op runs, its inputs, its outputs and its
``temp_bytes`` are all alive; right after, every value copy whose last read it was is
freed.  A block's ``incoming`` values (gradients from later blocks) are alive from the
backward's start to their last reader.  See NOTE [schedule model] in :mod:`remat_plugin.ir.problem`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from remat_plugin.ir.problem import Problem, Schedule


class InvalidScheduleError(ValueError):
    """A schedule reads a value that is not alive, or skips/repeats a backward op."""


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int
    time_ms: float
    recompute_ms: float
    kept_bytes: int  # forward values alive at the forward/backward boundary, live_out excluded
    timeline_bytes: tuple[int, ...]  # memory while each op of ``sequence`` runs
    sequence: tuple[str, ...]  # forward ops then bwd_sequence


class _Index:
    """A problem's ops and values as integer arrays, built once per problem: the simulator runs hundreds
    of times per plan (budget search, menus, hill climbing), and per-name lookups dominated it."""

    def __init__(self, problem: Problem):
        value_id = {v.name: i for i, v in enumerate(problem.values)}
        self.op_id = {o.name: i for i, o in enumerate(problem.ops)}
        self.value_names = [v.name for v in problem.values]
        self.size = np.array([v.size_bytes for v in problem.values], dtype=np.int64)
        self.live_out = np.array([v.name in problem.live_out for v in problem.values], dtype=bool)
        ins = [[value_id[v] for v in o.inputs] for o in problem.ops]
        outs = [[value_id[v] for v in o.outputs] for o in problem.ops]
        self.n_in = np.array([len(x) for x in ins], dtype=np.int64)
        self.n_out = np.array([len(x) for x in outs], dtype=np.int64)
        self.in_start = np.concatenate([[0], np.cumsum(self.n_in)]).astype(np.int64)
        self.out_start = np.concatenate([[0], np.cumsum(self.n_out)]).astype(np.int64)
        self.in_flat = np.array([v for x in ins for v in x], dtype=np.int64)
        self.out_flat = np.array([v for x in outs for v in x], dtype=np.int64)
        self.out_bytes = np.array([sum(int(self.size[v]) for v in x) for x in outs], dtype=np.int64)
        self.temp = np.array([o.temp_bytes for o in problem.ops], dtype=np.int64)
        self.times = np.array([o.time_ms for o in problem.ops], dtype=np.float64)
        self.is_fwd = np.array([o.is_fwd for o in problem.ops], dtype=bool)
        self.fwd = np.flatnonzero(self.is_fwd)
        self.fwd_names = tuple(o.name for o in problem.ops if o.is_fwd)
        self.rerunnable = np.array([o.recomputable or not o.is_fwd for o in problem.ops], dtype=bool)
        self.ops = problem.ops
        self.incoming = [(g.size_bytes, np.array([self.op_id[r] for r in g.readers], dtype=np.int64))
                         for g in problem.incoming]

    def gather(self, ids: np.ndarray, start: np.ndarray, count: np.ndarray, flat: np.ndarray):
        """(position, value) of every input (or output) of the ops at ``ids``, in sequence then op order."""
        n = count[ids]
        pos = np.repeat(np.arange(len(ids), dtype=np.int64), n)
        first = np.repeat(start[ids] - np.concatenate([[0], np.cumsum(n)[:-1]]), n)
        return pos, flat[first + np.arange(len(pos), dtype=np.int64)]


def _index(problem: Problem) -> _Index:
    cache = problem.__dict__.get("_sim_index")
    if cache is None:
        cache = _Index(problem)
        object.__setattr__(problem, "_sim_index", cache)
    return cache


def check_schedule(problem: Problem, schedule: Schedule) -> None:
    """Raise :class:`InvalidScheduleError` unless every backward op runs once and nothing unrecomputable reruns."""
    idx = _index(problem)
    _checked_ids(idx, schedule)


def _checked_ids(idx: _Index, schedule: Schedule) -> np.ndarray:
    """The op ids of ``schedule.bwd_sequence``, once it passes :func:`check_schedule`'s rules."""
    op_id = idx.op_id
    ids = np.fromiter(map(op_id.__getitem__, schedule.bwd_sequence), dtype=np.int64,
                      count=len(schedule.bwd_sequence))
    bad = np.flatnonzero(~idx.rerunnable[ids])
    if len(bad):
        raise InvalidScheduleError(f"op {schedule.bwd_sequence[bad[0]]!r} is not recomputable but is recomputed")
    seen = np.bincount(ids, minlength=len(idx.ops))
    wrong = np.flatnonzero((seen != 1) & ~idx.is_fwd)
    if len(wrong):
        name = idx.ops[wrong[0]].name
        raise InvalidScheduleError(f"backward op {name!r} runs {seen[wrong[0]]} times, not once")
    return ids


def _copy_deaths(idx: _Index, ids: np.ndarray, sequence: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every value copy the sequence makes: (position, value, position after which it dies).

    A copy dies after its last read (each read takes the latest copy made before it); one never
    read dies right after it is made; no copy of a ``live_out`` value dies (``len(ids)``).
    """
    read_pos, read_val = idx.gather(ids, idx.in_start, idx.n_in, idx.in_flat)
    made_pos, made_val = idx.gather(ids, idx.out_start, idx.n_out, idx.out_flat)
    # Events by value, then position; at one position reads come before the op's own outputs.
    n_read = len(read_pos)
    val = np.concatenate([read_val, made_val])
    pos = np.concatenate([read_pos, made_pos])
    is_made = np.concatenate([np.zeros(n_read, dtype=bool), np.ones(len(made_pos), dtype=bool)])
    if not len(val):  # nothing read or made (a block whose forward is empty)
        return made_pos, made_val, made_pos.copy()
    # One integer key (value, then position, then made) sorted stably: the order of a lexsort on the three.
    order = np.argsort((val * (len(ids) + 1) + pos) * 2 + is_made, kind="stable")
    made_sorted = is_made[order]
    copy_of_event = np.cumsum(made_sorted) - 1  # the latest copy (in made order) at or before each event
    val_sorted = val[order]
    group_start = np.flatnonzero(np.r_[True, val_sorted[1:] != val_sorted[:-1]])
    copies_before_group = np.repeat(copy_of_event[group_start] - made_sorted[group_start] + 1,
                                    np.diff(np.r_[group_start, len(order)]))
    reads = ~made_sorted
    orphan = reads & (copy_of_event < copies_before_group)
    if orphan.any():
        first = order[orphan].min()
        i = int(read_pos[first])
        made_before = set(made_val[made_pos < i].tolist())
        v = next(v for v in idx.in_flat[idx.in_start[ids[i]]:idx.in_start[ids[i] + 1]] if v not in made_before)
        raise InvalidScheduleError(
            f"op {sequence[i]!r} (position {i}) reads {idx.value_names[v]!r}, which is not alive")
    copy_pos = pos[order][made_sorted]
    copy_val = val_sorted[made_sorted]
    death = copy_pos.copy()
    np.maximum.at(death, copy_of_event[reads], pos[order][reads])
    death[idx.live_out[copy_val]] = len(ids)
    return copy_pos, copy_val, death


def value_lifetimes(problem: Problem, sequence: list[str]) -> list[dict[str, int]]:
    """For each position ``i``, map each output value of that copy to the position after which it dies.

    A copy dies after its last read; one never read dies right after it is made; no copy of a
    ``live_out`` value dies (``len(sequence)``): the forward returns its outputs to the caller, so
    recomputing one later cannot free the first copy.
    """
    idx = _index(problem)
    ids = np.array([idx.op_id[name] for name in sequence], dtype=np.int64)
    copy_pos, copy_val, death = _copy_deaths(idx, ids, tuple(sequence))
    out: list[dict[str, int]] = [{} for _ in sequence]
    for p, v, d in zip(copy_pos.tolist(), copy_val.tolist(), death.tolist()):
        out[p][idx.value_names[v]] = d
    return out


def _sequential_sum(x: np.ndarray) -> float:
    """``x`` summed left to right, bitwise as a Python loop would (``np.sum`` adds pairwise)."""
    return float(np.cumsum(x)[-1]) if len(x) else 0.0


def _incoming_bytes(idx: _Index, bwd_ids: np.ndarray, n_fwd: int) -> np.ndarray | int:
    """Per position, the bytes of the problem's incoming values alive (from the backward's start to the
    position of their last reader, each backward op running once)."""
    if not idx.incoming:
        return 0
    position = np.zeros(len(idx.ops), dtype=np.int64)
    position[bwd_ids] = np.arange(n_fwd, n_fwd + len(bwd_ids), dtype=np.int64)
    change = np.zeros(n_fwd + len(bwd_ids) + 1, dtype=np.int64)
    for size, readers in idx.incoming:
        change[n_fwd] += size
        change[int(position[readers].max()) + 1 if len(readers) else n_fwd] -= size
    return np.cumsum(change[:-1])


def simulate(problem: Problem, schedule: Schedule) -> Simulation:
    """Run ``schedule`` on paper: peak bytes, total time, and the memory timeline."""
    idx = _index(problem)
    bwd_ids = _checked_ids(idx, schedule)
    n_fwd = len(idx.fwd)
    ids = np.concatenate([idx.fwd, bwd_ids])
    sequence = idx.fwd_names + tuple(schedule.bwd_sequence)
    copy_pos, copy_val, death = _copy_deaths(idx, ids, sequence)
    end = len(ids)
    sizes = idx.size[copy_val]
    freed_after = np.zeros(end + 1, dtype=np.int64)
    np.add.at(freed_after, death, sizes)
    # While op i runs: everything made up to and including it, less what died after earlier ops, plus its temp.
    made = np.cumsum(idx.out_bytes[ids])
    freed = np.concatenate([[0], np.cumsum(freed_after[: end - 1])]) if end else np.zeros(0, dtype=np.int64)
    running = problem.base_bytes + made - freed + idx.temp[ids] + _incoming_bytes(idx, bwd_ids, n_fwd)
    timeline = running.tolist()
    peak = max(problem.base_bytes, int(running.max()) if end else problem.base_bytes)
    # Summed in sequence order, as the plans before this simulator were: a cumulative sum adds one term at a time.
    time_ms = _sequential_sum(idx.times[ids])
    recompute_ms = _sequential_sum(idx.times[bwd_ids[idx.is_fwd[bwd_ids]]])
    boundary = (copy_pos < n_fwd) & (death >= n_fwd) & (death < end)
    kept = int(sizes[boundary].sum())
    return Simulation(peak, time_ms, recompute_ms, kept, tuple(timeline), sequence)


def simulate_within(
    problem: Problem, schedule: Schedule, peak_budget_bytes: int, kept_budget_bytes: int | None = None
) -> Simulation | None:
    """The simulation of ``schedule`` if it is valid and within both budgets, else None."""
    try:
        sim = simulate(problem, schedule)
    except InvalidScheduleError:
        return None
    if sim.peak_bytes > peak_budget_bytes or (kept_budget_bytes is not None and sim.kept_bytes > kept_budget_bytes):
        return None
    return sim
