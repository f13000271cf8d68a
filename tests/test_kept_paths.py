"""Kept-path block menus (NOTE [kept paths]): simulated, Pareto, from keep-all down to the must-keep set."""
from __future__ import annotations

import pytest

from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import simulate
from remat_plugin.planning.solvers.greedy import must_keep, recompute_on_demand
from remat_plugin.planning.solvers.kept_paths import kept_path_menu
from test_ilp import chain, diamond, with_unrecomputable

PROBLEMS = {
    "chain6": lambda: chain(6),
    "diamond": diamond,
    "unrecomputable": with_unrecomputable,
}


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_options_are_simulated_pareto_and_span_the_kept_axis(name: str) -> None:
    problem: Problem = PROBLEMS[name]()
    menu = kept_path_menu(problem)
    n_fwd = len(problem.fwd_ops)
    for o in menu:
        sim = simulate(problem, o.schedule)
        assert o.kept_bytes == sim.kept_bytes
        assert o.fwd_peak_bytes == max(sim.timeline_bytes[:n_fwd])
        assert o.bwd_peak_bytes == max(sim.timeline_bytes[n_fwd:])
        assert abs(o.fwd_ms + o.bwd_ms - sim.time_ms) < 1e-9
    keys = [(o.kept_bytes, o.fwd_peak_bytes, o.bwd_peak_bytes, o.fwd_ms + o.bwd_ms) for o in menu]
    for a in keys:
        assert not any(b != a and all(x <= y for x, y in zip(b, a)) for b in keys), f"{a} is dominated"
    keep_all = simulate(problem, Schedule.keep_all(problem))
    assert min(k[3] for k in keys) == keep_all.time_ms  # the fastest option recomputes nothing
    least = simulate(problem, recompute_on_demand(problem, must_keep(problem)))
    assert min(o.kept_bytes for o in menu) <= least.kept_bytes  # the must-keep end of both paths


def test_dropping_path_drops_the_cheapest_bytes_first() -> None:
    """a1 is 40 bytes remade in 0.1 ms from a kept a0; a0 and a2 are 4 bytes each at 2 ms: a1 goes first."""
    problem = chain(3, sizes=[4, 40, 4], times=[2.0, 0.1, 2.0])
    menu = kept_path_menu(problem)
    keep_all = simulate(problem, Schedule.keep_all(problem))
    second = sorted(menu, key=lambda o: o.fwd_ms + o.bwd_ms)[1]
    assert second.kept_bytes == keep_all.kept_bytes - 40
    assert abs(second.fwd_ms + second.bwd_ms - keep_all.time_ms - 0.1) < 1e-9
