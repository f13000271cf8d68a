"""simulate() on a 3-op forward + 2-op backward problem: memory timelines computed by hand."""
from __future__ import annotations

import pytest

from remat_plugin.ir.problem import Op, Problem, Schedule, Value
from remat_plugin.ir.simulate import InvalidScheduleError, simulate, simulate_within


def problem(base_bytes: int = 0, f0_recomputable: bool = True) -> Problem:
    """f0: () -> a(20); f1: a -> b(10); f2: b -> c(5, model output, live_out);
    b2: b -> gb(10), temp 30; b1: (a, gb) -> ga(20, live_out, think weight grad).  Times 1..5 ms."""
    ops = (
        Op("f0", True, (), ("a",), 1.0, recomputable=f0_recomputable),
        Op("f1", True, ("a",), ("b",), 2.0),
        Op("f2", True, ("b",), ("c",), 3.0),
        Op("b2", False, ("b",), ("gb",), 4.0, temp_bytes=30),
        Op("b1", False, ("a", "gb"), ("ga",), 5.0),
    )
    values = (
        Value("a", 20, "f0"), Value("b", 10, "f1"), Value("c", 5, "f2"), Value("gb", 10, "b2"), Value("ga", 20, "b1"),
    )
    return Problem(ops, values, frozenset({"c", "ga"}), base_bytes)


# (bwd_sequence, base_bytes, peak, kept, time_ms, recompute_ms, timeline)
# Each timeline entry is the bytes alive while that op runs: base + values alive + its outputs + its temp.
CASES = {
    # keep-all: f0 +a=20 | f1 +b=30 | f2 +c=35 | b2 +gb+temp 35+10+30=75, then b (last read) dies: 35
    # | b1 +ga=55.  Kept at the boundary: a (read by b1) + b (read by b2) = 30; c is live_out, excluded.
    "keep_all": (("b2", "b1"), 0, 75, 30, 15.0, 0.0, (20, 30, 35, 75, 55)),
    # same with 7 bytes alive all along: every timeline point and the peak move by 7, kept does not
    "keep_all_base7": (("b2", "b1"), 7, 82, 30, 15.0, 0.0, (27, 37, 42, 82, 62)),
    # recompute a just before b1: the first a dies after f1 (its last read), so
    # f0 20 | f1 30, a dies: 10 | f2 15 | b2 15+10+30=55, b dies: 15 | f0 again 35 | b1 55.
    # Kept: only b = 10.  Time 15 + 1 ms of recomputation.
    "recompute_a": (("b2", "f0", "b1"), 0, 55, 10, 16.0, 1.0, (20, 30, 15, 55, 35, 55)),
    # recompute everything at the start of the backward: nothing kept, but b2 then runs with a and b
    # both alive again: f0 20 | f1 30 -> 10 | f2 15 -> 5 (b dies) | f0 25 | f1 35 | b2 35+10+30=75
    # -> 35 | b1 55.  Peak unchanged at 75, 3 ms of recomputation.
    "recompute_all_early": (("f0", "f1", "b2", "b1"), 0, 75, 0, 18.0, 3.0, (20, 30, 15, 25, 35, 75, 55)),
    # recompute b only: f0 20 | f1 30 | f2 35, b dies: 25 | f1 again 35 | b2 35+10+30=75 | b1 55.
    # a is kept (read by the recomputed f1, then by b1): kept 20, peak 75, 2 ms recomputed.
    "recompute_b": (("f1", "b2", "b1"), 0, 75, 20, 17.0, 2.0, (20, 30, 35, 35, 75, 55)),
}


@pytest.mark.parametrize("name", CASES)
def test_timeline(name: str) -> None:
    """Peak, kept bytes, times and the per-op timeline equal the hand-computed ones."""
    seq, base, peak, kept, time_ms, recompute_ms, timeline = CASES[name]
    sim = simulate(problem(base), Schedule(seq))
    assert sim.sequence == ("f0", "f1", "f2", *seq)
    assert sim.timeline_bytes == timeline
    assert sim.peak_bytes == peak == max(timeline)
    assert sim.kept_bytes == kept
    assert sim.time_ms == pytest.approx(time_ms)
    assert sim.recompute_ms == pytest.approx(recompute_ms)


def test_keep_all_schedule_is_backward_order() -> None:
    """Schedule.keep_all lists the backward ops in problem order."""
    assert Schedule.keep_all(problem()) == Schedule(("b2", "b1"))


# (bwd_sequence, peak budget, kept budget, fits): keep-all peaks at 75 with 30 kept, recompute_a at 55 / 10
WITHIN_CASES = [
    (("b2", "b1"), 75, None, True),
    (("b2", "b1"), 74, None, False),
    (("b2", "b1"), 75, 30, True),
    (("b2", "b1"), 75, 29, False),
    (("b2", "f0", "b1"), 55, 10, True),
    (("b2", "f0", "b1"), 54, 10, False),
    (("b2", "f0", "b1"), 55, 9, False),
    (("b1", "b2"), 10**9, None, False),  # invalid: None, not an exception
]


@pytest.mark.parametrize(("seq", "peak", "kept", "fits"), WITHIN_CASES)
def test_simulate_within(seq: tuple[str, ...], peak: int, kept: int | None, fits: bool) -> None:
    """simulate_within returns the simulation exactly when the peak and kept budgets both hold."""
    got = simulate_within(problem(), Schedule(seq), peak, kept)
    if fits:
        assert got == simulate(problem(), Schedule(seq))
    else:
        assert got is None


# (bwd_sequence, f0 recomputable, error message fragment)
INVALID_CASES = {
    "bwd_out_of_order": (("b1", "b2"), True, "op 'b1' \\(position 3\\) reads 'gb', which is not alive"),
    "bwd_missing": (("b2",), True, "backward op 'b1' runs 0 times, not once"),
    "bwd_twice": (("b2", "b2", "b1"), True, "backward op 'b2' runs 2 times, not once"),
    "unrecomputable_rerun": (("b2", "f0", "b1"), False, "op 'f0' is not recomputable but is recomputed"),
}


@pytest.mark.parametrize("name", INVALID_CASES)
def test_invalid_schedule_raises(name: str) -> None:
    """Schedules that read a missing value, skip/repeat a backward op or rerun an unrecomputable op are refused."""
    seq, recomputable, message = INVALID_CASES[name]
    with pytest.raises(InvalidScheduleError, match=message):
        simulate(problem(f0_recomputable=recomputable), Schedule(seq))
