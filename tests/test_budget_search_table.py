"""Budget search (fastest_fitting, hill_climb) and make_plan on a 4-layer chain with hand-known optima."""
from __future__ import annotations

import itertools

import pytest

from remat_plugin.errors import InfeasibleBudgetError
from remat_plugin.ir.plan import budget_for_peak
from remat_plugin.ir.problem import Op, Problem, Schedule, Value
from remat_plugin.ir.simulate import simulate
from remat_plugin.planning.budget_search import fastest_fitting, hill_climb
from remat_plugin.planning.choose_plan import PlannerCache, make_plan
from remat_plugin.planning.menus import Planner

MiB = 1 << 20
ILP_S = 0.2


def chain4() -> Problem:
    """4 Linear+ReLU layers, every value 1 MiB.

    Forward: mm_i (1 ms) reads relu_{i-1} (the weight and the input are placeholders), relu_i (0.5 ms)
    reads mm_i; relu_3 is the model output (live_out).  Backward: ``tangents`` (0 ms) then, per layer
    from the top, bwd_relu_i (1 ms) reads mm_i and the gradient from above, bwd_mm_i (2 ms) reads
    relu_{i-1} and bwd_relu_i.

    By hand: keep-all takes 4 * 1.5 + 4 * 3 = 18 ms.  After the forward all 8 activations are alive
    (7 MiB kept, relu_3 is live_out); tangents makes 9 MiB and bwd_relu_3 running makes 10 MiB, the
    keep-all peak; from there each backward op frees more than it makes.
    """
    ops: list[Op] = []
    for i in range(4):
        ops.append(Op(f"mm_{i}", True, (f"relu_{i - 1}",) if i else (), (f"mm_{i}",), 1.0))
        ops.append(Op(f"relu_{i}", True, (f"mm_{i}",), (f"relu_{i}",), 0.5))
    ops.append(Op("tangents", False, (), ("tangents",), 0.0))
    for i in reversed(range(4)):
        grad_above = f"bwd_mm_{i + 1}" if i < 3 else "tangents"
        ops.append(Op(f"bwd_relu_{i}", False, (f"mm_{i}", grad_above), (f"bwd_relu_{i}",), 1.0))
        ops.append(Op(f"bwd_mm_{i}", False, ((f"relu_{i - 1}",) if i else ()) + (f"bwd_relu_{i}",), (f"bwd_mm_{i}",), 2.0))
    values = tuple(Value(o.outputs[0], MiB, o.name) for o in ops)
    return Problem(tuple(ops), values, frozenset({"relu_3"}))


KEEP_ALL_PEAK = 10 * MiB
KEEP_ALL_MS = 18.0
# The chain form's floor: block 3's backward (cut after each relu) needs tangents, mm_3, the live
# relu_3 and its output bwd_relu_3 (4 MiB) while the chain keeps its input relu_2: 5 MiB.
FLOOR_PEAK = 5 * MiB


def planner() -> Planner:
    p = Planner(chain4(), set(), ilp_time_limit_s=ILP_S)
    p.prepare()
    return p


def search(pl: Planner, budget: int):
    """The pipeline make_plan runs: fastest_fitting, then hill_climb."""
    found = fastest_fitting(pl, budget)
    assert found is not None, f"nothing fits {budget / MiB} MiB"
    return hill_climb(pl, budget, found)


def test_hand_numbers_of_the_problem() -> None:
    """Keep-all peak/time and the chain floor are the hand-derived ones."""
    p = chain4()
    sim = simulate(p, Schedule.keep_all(p))
    assert (sim.peak_bytes, sim.time_ms, sim.kept_bytes) == (KEEP_ALL_PEAK, KEEP_ALL_MS, 7 * MiB)
    pl = planner()
    assert [b.fwd_ops for b in pl.blocks] == [(f"mm_{i}", f"relu_{i}") for i in range(4)]
    floor = pl.try_budget(pl.min_dp_budget())
    assert floor is not None and floor[1].peak_bytes == FLOOR_PEAK


# budget (MiB) -> least time by hand, or None where the argument is not simple.  At keep-all's peak
# moment (bwd_relu_3) tangents, bwd_relu_3, mm_3 and relu_3 must be alive; going k MiB under 10 needs k
# of mm_0..2, relu_0..2 dropped there and recomputed later.  The backward reads all of them, so each
# costs its op time at least; relus (0.5 ms) are the cheapest and there are 3 of them, and dropping
# relu_k then recomputing it from the kept mm_k just before bwd_mm_{k+1} stays within the budget.
OPTIMA = {10: 18.0, 9: 18.5, 8: 19.0, 7: 19.5, 6: None, 5: None}
# at 6 MiB the 4th dropped value is an mm (>= 1 ms): the optimum is >= 18 + 1.5 + 1.0 = 20.5 ms
LOWER_BOUNDS = {6: 20.5, 5: 20.5}


@pytest.mark.parametrize("budget_mib", sorted(OPTIMA))
def test_search_fits_and_matches_hand_optimum(budget_mib: int) -> None:
    """The searched schedule's simulated peak fits; its time is the hand optimum (or above the hand bound)."""
    p = chain4()
    budget = budget_mib * MiB
    sched, sim, _cp = search(planner(), budget)
    again = simulate(p, sched)
    assert again == sim
    assert again.peak_bytes <= budget
    if OPTIMA[budget_mib] is not None:
        assert sim.time_ms == pytest.approx(OPTIMA[budget_mib])
        assert sim.recompute_ms == pytest.approx(OPTIMA[budget_mib] - KEEP_ALL_MS)
    else:
        assert sim.time_ms >= LOWER_BOUNDS[budget_mib] - 1e-9


def test_time_non_increasing_with_budget() -> None:
    """More memory never makes the searched schedule slower (floor .. keep-all, half-MiB steps)."""
    pl = planner()
    times = []
    for half_mib in range(2 * FLOOR_PEAK // MiB, 2 * KEEP_ALL_PEAK // MiB + 1):
        budget = half_mib * MiB // 2
        _s, sim, _cp = search(pl, budget)
        assert sim.peak_bytes <= budget
        times.append(sim.time_ms)
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(times)), times
    assert times[-1] == pytest.approx(KEEP_ALL_MS)


@pytest.mark.parametrize("budget", [KEEP_ALL_PEAK, KEEP_ALL_PEAK + 1, 2 * KEEP_ALL_PEAK])
def test_keep_all_budget_recomputes_nothing(budget: int) -> None:
    """At or above the keep-all peak fastest_fitting returns plain autograd's schedule."""
    p = chain4()
    sched, sim, _cp = fastest_fitting(planner(), budget)
    assert sched == Schedule.keep_all(p)
    assert (sim.recompute_ms, sim.time_ms, sim.peak_bytes) == (0.0, KEEP_ALL_MS, KEEP_ALL_PEAK)


def test_fastest_fitting_below_floor_is_none() -> None:
    """One byte under the chain floor nothing the DP makes fits."""
    assert fastest_fitting(planner(), FLOOR_PEAK - 1) is None


# (budget the start candidate is found at, budget the polish runs at), in MiB
POLISH_CASES = [(5, 5), (5, 6), (5, 8), (5, 10), (6, 6), (6, 9), (7, 7), (8, 10)]


@pytest.mark.parametrize(("start_mib", "budget_mib"), POLISH_CASES)
def test_hill_climb_never_worse(start_mib: int, budget_mib: int) -> None:
    """hill_climb returns a candidate no slower than its input whose simulated peak fits."""
    p = chain4()
    pl = planner()
    start = fastest_fitting(pl, start_mib * MiB)
    assert start is not None and start[1].peak_bytes <= budget_mib * MiB
    out = hill_climb(pl, budget_mib * MiB, start)
    sim = simulate(p, out[0])
    assert sim == out[1]
    assert sim.peak_bytes <= budget_mib * MiB
    assert sim.time_ms <= start[1].time_ms + 1e-9


def test_hill_climb_improves_floor_plan_with_room() -> None:
    """Polished at the keep-all budget, the floor plan gets strictly faster and still fits."""
    pl = planner()
    floor = pl.try_budget(pl.min_dp_budget())
    # the floor plan recomputes (>= 1 block on a recomputing option, plus fwd_none reruns): slower than 18 ms
    assert floor[1].time_ms > KEEP_ALL_MS
    out = hill_climb(pl, KEEP_ALL_PEAK, floor)
    assert out[1].peak_bytes <= KEEP_ALL_PEAK
    # hill_climb only swaps backward options; the floor plan's fwd_none reruns stay, so it need not
    # reach 18 ms, but with 5 MiB of room some block's faster option fits
    assert KEEP_ALL_MS <= out[1].time_ms < floor[1].time_ms


# make_plan works on the usable part of the budget (budget - safety margin, 64 KiB at these sizes);
# budget_for_peak(k MiB) is the least budget whose usable part is k MiB: k MiB + 64 KiB here.
PLAN_CASES = {10: 18.0, 9: 18.5, 7: 19.5}


@pytest.mark.parametrize("peak_mib", sorted(PLAN_CASES))
def test_make_plan_time(peak_mib: int) -> None:
    """make_plan predicts the hand-optimal time where one is known, and its peak fits."""
    budget = budget_for_peak(peak_mib * MiB)
    assert budget == peak_mib * MiB + 64 * 1024
    plan, sched = make_plan(chain4(), set(), budget, ILP_S)
    sim = simulate(chain4(), sched)
    assert sim.peak_bytes == plan.predicted_peak_bytes <= peak_mib * MiB
    assert plan.predicted_time_ms == pytest.approx(PLAN_CASES[peak_mib]) == sim.time_ms
    assert plan.min_feasible_bytes == FLOOR_PEAK + 64 * 1024


@pytest.mark.parametrize("below", [1, 1024, MiB])
def test_make_plan_below_floor_raises(below: int) -> None:
    """Below the floor make_plan raises InfeasibleBudgetError carrying the least workable budget."""
    floor_budget = FLOOR_PEAK + 64 * 1024  # = budget_for_peak(FLOOR_PEAK)
    with pytest.raises(InfeasibleBudgetError) as err:
        make_plan(chain4(), set(), floor_budget - below, ILP_S)
    assert err.value.min_feasible_bytes == floor_budget
    assert err.value.budget_bytes == floor_budget - below
    plan, _ = make_plan(chain4(), set(), floor_budget, ILP_S)
    assert plan.predicted_peak_bytes <= FLOOR_PEAK


def test_lowest_peak_never_above_the_dp_floor_and_is_simulated() -> None:
    """lowest_peak (DP budgets near the least one, then single-block swaps judged by the simulator) returns a
    schedule whose stored simulation is its real one, at most the DP's least-budget peak; make_plan reports it."""
    from remat_plugin.planning.budget_search import lowest_peak

    pl = planner()
    dp_floor = pl.try_budget(pl.min_dp_budget())
    assert dp_floor is not None
    sched, sim, _cp = lowest_peak(pl)
    assert simulate(pl.problem, sched) == sim
    assert sim.peak_bytes <= dp_floor[1].peak_bytes
    plan, _ = make_plan(chain4(), set(), 10 * KEEP_ALL_PEAK, ILP_S)
    assert plan.min_feasible_bytes <= budget_for_peak(sim.peak_bytes)


def scaled(problem: Problem, k: int) -> Problem:
    """``problem`` with every size and time times ``k``: what a k-times larger batch looks like."""
    ops = tuple(Op(o.name, o.is_fwd, o.inputs, o.outputs, o.time_ms * k, o.temp_bytes * k, o.recomputable)
                for o in problem.ops)
    values = tuple(Value(v.name, v.size_bytes * k, v.producer) for v in problem.values)
    return Problem(ops, values, problem.live_out, problem.base_bytes * k)


def test_menus_carry_over_to_another_batch_size() -> None:
    """NOTE [menus across shapes]: a problem with the same blocks at twice the sizes takes the menus solved
    before, re-costed by the simulator, instead of solving them; its menus and plan equal a cold planner's."""
    cache, cold = PlannerCache(), PlannerCache()
    make_plan(chain4(), set(), 10**12, ILP_S, planners=cache)
    big = scaled(chain4(), 2)
    warm_plan, warm_schedule = make_plan(big, set(), 2 * budget_for_peak(7 * MiB), ILP_S, planners=cache)
    warm = cache.prepared(big, set(), ILP_S)
    assert warm.n_transferred == warm.n_unique > 0
    cold_plan, _ = make_plan(big, set(), 2 * budget_for_peak(7 * MiB), ILP_S, planners=cold)
    fresh = cold.prepared(big, set(), ILP_S)
    assert fresh.n_transferred == 0 and len(fresh.solved_keys) == fresh.n_unique

    def costs(menu):
        return sorted((o.kept_bytes, o.fwd_peak_bytes, o.bwd_peak_bytes, round(o.fwd_ms + o.bwd_ms, 9)) for o in menu)

    for b, menu in zip(warm.blocks, warm.menus):
        assert costs(menu) == costs(fresh.menus[b.index])
        for option in menu:  # every number is the simulator's at the new sizes
            sim = simulate(b.problem, option.schedule)
            assert sim.kept_bytes == option.kept_bytes and abs(sim.time_ms - option.fwd_ms - option.bwd_ms) < 1e-9
    assert (warm_plan.predicted_peak_bytes, warm_plan.predicted_time_ms) == (
        cold_plan.predicted_peak_bytes, cold_plan.predicted_time_ms)
    assert simulate(big, warm_schedule).peak_bytes <= 2 * budget_for_peak(7 * MiB)


def test_menus_do_not_carry_over_to_another_structure() -> None:
    """A block whose values stay alive differently (another output kept) is solved, not given a menu."""
    cache = PlannerCache()
    make_plan(chain4(), set(), 10**12, ILP_S, planners=cache)
    other = chain4()
    other = Problem(other.ops, other.values, other.live_out | {"relu_1"})
    make_plan(other, set(), 10**12, ILP_S, planners=cache)
    planner = cache.prepared(other, set(), ILP_S)
    changed = [b for b in planner.blocks if "relu_1" in b.problem.live_out]
    assert changed and planner.n_transferred < planner.n_unique
    assert all(b.key in planner.solved_keys for b in changed)
