"""simulate() (index arrays, vectorised) agrees with a plain per-name reading of NOTE [schedule model].

The reference below is the simulator as it was written first: one dict per position, names
looked up one by one.  Random problems and random (valid and invalid) schedules must give the
same Simulation, the same lifetimes, and the same error message.
"""
from __future__ import annotations

import dataclasses
import random

import pytest

from remat_plugin.ir.problem import Incoming, Op, Problem, Schedule, Value
from remat_plugin.ir.simulate import InvalidScheduleError, Simulation, simulate, value_lifetimes


def reference_lifetimes(problem: Problem, sequence: list[str]) -> list[dict[str, int]]:
    latest: dict[str, int] = {}
    death: list[dict[str, int]] = []
    for i, name in enumerate(sequence):
        op = problem.op(name)
        for v in op.inputs:
            if v not in latest:
                raise InvalidScheduleError(f"op {name!r} (position {i}) reads {v!r}, which is not alive")
            death[latest[v]][v] = i
        death.append({v: i for v in op.outputs})
        for v in op.outputs:
            latest[v] = i
    for i, name in enumerate(sequence):
        for v in problem.op(name).outputs:
            if v in problem.live_out:
                death[i][v] = len(sequence)
    return death


def reference_simulate(problem: Problem, schedule: Schedule) -> Simulation:
    seen: dict[str, int] = {}
    for name in schedule.bwd_sequence:
        op = problem.op(name)
        if op.is_fwd and not op.recomputable:
            raise InvalidScheduleError(f"op {name!r} is not recomputable but is recomputed")
        seen[name] = seen.get(name, 0) + 1
    for op in problem.bwd_ops:
        if seen.get(op.name, 0) != 1:
            raise InvalidScheduleError(f"backward op {op.name!r} runs {seen.get(op.name, 0)} times, not once")
    fwd = [o.name for o in problem.fwd_ops]
    sequence = fwd + list(schedule.bwd_sequence)
    death = reference_lifetimes(problem, sequence)
    freed_after = [0] * (len(sequence) + 1)
    for deaths in death:
        for v, d in deaths.items():
            freed_after[d] += problem.value(v).size_bytes
    last_read = {g.name: max(i for i, name in enumerate(sequence) if name in g.readers) for g in problem.incoming}
    alive = peak = problem.base_bytes
    timeline, time_ms, recompute_ms, kept = [], 0.0, 0.0, 0
    for i, name in enumerate(sequence):
        op = problem.op(name)
        alive += sum(problem.value(v).size_bytes for v in op.outputs)
        incoming = sum(g.size_bytes for g in problem.incoming if len(fwd) <= i <= last_read[g.name])
        timeline.append(alive + op.temp_bytes + incoming)
        peak = max(peak, alive + op.temp_bytes + incoming)
        time_ms += op.time_ms
        if op.is_fwd and i >= len(fwd):
            recompute_ms += op.time_ms
        alive -= freed_after[i]
        if i == len(fwd) - 1:
            kept = sum(problem.value(v).size_bytes for j in range(len(fwd)) for v, d in death[j].items()
                       if len(fwd) <= d < len(sequence))
    return Simulation(peak, time_ms, recompute_ms, kept, tuple(timeline), tuple(sequence))


def random_problem(rng: random.Random) -> Problem:
    """A random forward DAG, one backward op per forward op (reading its inputs and the next gradient)."""
    n = rng.randint(1, 9)
    ops, values = [], []
    for i in range(n):
        reads = tuple(sorted(rng.sample([f"v{j}" for j in range(i)], k=min(i, rng.randint(0, 2)))))
        outs = tuple(f"v{i}" if k == 0 else f"v{i}_{k}" for k in range(rng.choice((1, 1, 2))))
        ops.append(Op(f"f{i}", True, reads, outs, rng.uniform(0.1, 3), rng.randint(0, 40), rng.random() > 0.2))
        values += [Value(v, rng.randint(1, 100), f"f{i}") for v in outs]
    for i in reversed(range(n)):
        reads = tuple(v.name for v in values if v.producer == f"f{i}")[:1] + ops[i].inputs
        if i < n - 1:
            reads += (f"g{i + 1}",)
        ops.append(Op(f"b{i}", False, reads, (f"g{i}",), rng.uniform(0.1, 3), rng.randint(0, 40)))
        values.append(Value(f"g{i}", rng.randint(1, 100), f"b{i}"))
    live_out = frozenset(v.name for v in values if rng.random() < 0.15) | {"g0"}
    bwd = [o.name for o in ops if not o.is_fwd]
    incoming = tuple(Incoming(f"in{k}", rng.randint(1, 100), tuple(rng.sample(bwd, k=rng.randint(1, min(2, n)))))
                     for k in range(rng.choice((0, 0, 1, 2))))  # a later block's gradients
    return Problem(tuple(ops), tuple(values), live_out, rng.randint(0, 50), incoming)


def random_schedule(problem: Problem, rng: random.Random) -> Schedule:
    """Plain autograd order with random recomputations, and now and then a broken schedule."""
    seq: list[str] = []
    for b in problem.bwd_ops:
        if rng.random() < 0.5:
            fwd = [o.name for o in problem.fwd_ops]
            start = rng.randrange(len(fwd))
            seq += fwd[start : start + rng.randint(1, 3)]
        seq.append(b.name)
    if rng.random() < 0.2 and seq:
        del seq[rng.randrange(len(seq))]
    if rng.random() < 0.1 and seq:
        seq.append(seq[0])
    return Schedule(tuple(seq))


def outcome(fn, *args):
    try:
        result = fn(*args)
    except InvalidScheduleError as err:
        return "error", str(err)
    return "ok", dataclasses.astuple(result) if dataclasses.is_dataclass(result) else result


@pytest.mark.parametrize("seed", range(6))
def test_simulate_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    kinds = {"ok": 0, "error": 0}
    for _ in range(150):
        problem = random_problem(rng)
        schedule = random_schedule(problem, rng)
        got, want = outcome(simulate, problem, schedule), outcome(reference_simulate, problem, schedule)
        assert got == want, schedule
        kinds[got[0]] += 1
        sequence = [o.name for o in problem.fwd_ops] + list(schedule.bwd_sequence)
        assert outcome(value_lifetimes, problem, sequence) == outcome(reference_lifetimes, problem, sequence)
    assert kinds["ok"] > 20 and kinds["error"] > 20, kinds  # both paths were exercised
