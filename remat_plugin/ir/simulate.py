"""The one simulator: memory timeline and time of a schedule (the spec all solvers answer to).

Memory is counted in bytes above what is alive when the step starts (parameters and
inputs are outside the problem).  While an op runs, its inputs, its outputs and its
``temp_bytes`` are all alive; right after, every value copy whose last read it was is
freed.  See NOTE [schedule model] in :mod:`remat_plugin.ir.problem`.
"""
from __future__ import annotations

from dataclasses import dataclass

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


def check_schedule(problem: Problem, schedule: Schedule) -> None:
    """Raise :class:`InvalidScheduleError` unless every backward op runs once and nothing unrecomputable reruns."""
    seen: dict[str, int] = {}
    for name in schedule.bwd_sequence:
        op = problem.op(name)
        if op.is_fwd and not op.recomputable:
            raise InvalidScheduleError(f"op {name!r} is not recomputable but is recomputed")
        seen[name] = seen.get(name, 0) + 1
    for op in problem.bwd_ops:
        if seen.get(op.name, 0) != 1:
            raise InvalidScheduleError(f"backward op {op.name!r} runs {seen.get(op.name, 0)} times, not once")


def value_lifetimes(problem: Problem, sequence: list[str]) -> list[dict[str, int]]:
    """For each position ``i``, map each output value of that copy to the position after which it dies.

    A copy dies after its last read; one never read dies right after it is made; no copy of a
    ``live_out`` value dies (``len(sequence)``): the forward returns its outputs to the caller, so
    recomputing one later cannot free the first copy.
    """
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
    end = len(sequence)
    for i, name in enumerate(sequence):
        for v in problem.op(name).outputs:
            if v in problem.live_out:  # every copy: a forward output is the caller's once returned
                death[i][v] = end
    return death


def simulate(problem: Problem, schedule: Schedule) -> Simulation:
    """Run ``schedule`` on paper: peak bytes, total time, and the memory timeline."""
    check_schedule(problem, schedule)
    fwd = [o.name for o in problem.fwd_ops]
    sequence = fwd + list(schedule.bwd_sequence)
    death = value_lifetimes(problem, sequence)
    freed_after = [0] * (len(sequence) + 1)
    for deaths in death:
        for v, d in deaths.items():
            freed_after[d] += problem.value(v).size_bytes
    alive = problem.base_bytes
    peak = alive
    timeline: list[int] = []
    time_ms = recompute_ms = 0.0
    kept = 0
    for i, name in enumerate(sequence):
        op = problem.op(name)
        alive += sum(problem.value(v).size_bytes for v in op.outputs)
        running = alive + op.temp_bytes
        timeline.append(running)
        peak = max(peak, running)
        time_ms += op.time_ms
        if op.is_fwd and i >= len(fwd):
            recompute_ms += op.time_ms
        alive -= freed_after[i]
        if i == len(fwd) - 1:
            kept = sum(
                problem.value(v).size_bytes
                for j in range(len(fwd))
                for v, d in death[j].items()
                if len(fwd) <= d < len(sequence)
            )
    return Simulation(peak, time_ms, recompute_ms, kept, tuple(timeline), tuple(sequence))


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
