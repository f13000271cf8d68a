"""Block ILP: solver claims checked against the simulator and against brute force on tiny graphs."""

from __future__ import annotations

import itertools

import pulp
import pytest

from remat_plugin.ir.problem import Incoming, Op, Problem, Schedule, Value
from remat_plugin.ir.simulate import simulate
from remat_plugin.planning.solvers.greedy import UnrecomputableValueError, recompute_on_demand
from remat_plugin.planning.solvers.ilp import BlockOption, block_menu, solve_schedule
from remat_plugin.planning.solvers import pulp_backend


def _problem(
    fwd: list[Op], bwd: list[Op], sizes: dict[str, int], live_out: frozenset[str] = frozenset(), base: int = 0
) -> Problem:
    producer = {v: o.name for o in fwd + bwd for v in o.outputs}
    values = tuple(Value(v, sizes[v], producer[v]) for v in producer)
    return Problem(tuple(fwd + bwd), values, live_out, base)


def chain(n: int, sizes: list[int] | None = None, times: list[float] | None = None) -> Problem:
    """f_i: a_{i-1} -> a_i; b_i: (a_{i-1}, a_i, g_{i+1}) -> g_i, backward mirrored."""
    sizes = sizes or [10 * (1 + i % 3) for i in range(n)]
    times = times or [1.0 + i % 2 for i in range(n)]
    fwd = [Op(f"f{i}", True, (f"a{i - 1}",) if i else (), (f"a{i}",), times[i]) for i in range(n)]
    bwd = []
    for i in reversed(range(n)):
        ins = ((f"a{i - 1}",) if i else ()) + (f"a{i}",) + ((f"g{i + 1}",) if i < n - 1 else ())
        bwd.append(Op(f"b{i}", False, ins, (f"g{i}",), 2 * times[i]))
    s = {f"a{i}": sizes[i] for i in range(n)} | {f"g{i}": 2 for i in range(n)}
    return _problem(fwd, bwd, s)


def diamond() -> Problem:
    """A residual block: x -> (h1 -> h2) + x -> y, with temp bytes and a multi-output op."""
    fwd = [
        Op("fx", True, (), ("x",), 1.0),
        Op("f1", True, ("x",), ("h1", "stats"), 3.0, temp_bytes=7),
        Op("f2", True, ("h1",), ("h2",), 2.0),
        Op("fy", True, ("h2", "x"), ("y",), 1.0),
    ]
    bwd = [
        Op("by", False, ("y",), ("gy",), 1.0),
        Op("b2", False, ("gy", "h1", "h2"), ("gh1",), 2.0, temp_bytes=5),
        Op("b1", False, ("gh1", "x", "stats"), ("gx1",), 2.0),
        Op("bx", False, ("gx1", "gy", "x"), ("gx",), 1.0),
    ]
    sizes = {"x": 8, "h1": 16, "stats": 2, "h2": 16, "y": 8, "gy": 8, "gh1": 16, "gx1": 8, "gx": 8}
    return _problem(fwd, bwd, sizes, live_out=frozenset({"gx"}), base=3)


def with_unrecomputable() -> Problem:
    """A 4-op chain whose second op (think: dropout with RNG) may not be recomputed."""
    p = chain(4)
    ops = tuple(Op(o.name, o.is_fwd, o.inputs, o.outputs, o.time_ms, o.temp_bytes, o.name != "f1") for o in p.ops)
    return Problem(ops, p.values, p.live_out, p.base_bytes)


def brute_force_frontier(problem: Problem) -> list[tuple[int, float]]:
    """(peak, recompute ms) of every valid schedule; stage t only reruns ancestors of what stages >= t read."""
    fwd = problem.fwd_ops
    ancestors: dict[str, set[str]] = {}
    for o in fwd:
        ancestors[o.name] = {o.name}.union(*(ancestors[problem.value(v).producer] for v in o.inputs))
    stage_subsets = []
    useful: set[str] = set()
    for b in reversed(problem.bwd_ops):
        useful |= {
            a for v in b.inputs if problem.value(v).producer in ancestors for a in ancestors[problem.value(v).producer]
        }
        names = [o.name for o in fwd if o.name in useful and o.recomputable]
        stage_subsets.append([c for k in range(len(names) + 1) for c in itertools.combinations(names, k)])
    frontier = []
    for stages in itertools.product(*reversed(stage_subsets)):
        seq = tuple(x for sub, b in zip(stages, problem.bwd_ops) for x in (*sub, b.name))
        try:
            sim = simulate(problem, Schedule(seq))
        except ValueError:
            continue
        frontier.append((sim.peak_bytes, sim.recompute_ms))
    return frontier


def with_incoming(p: Problem, readers: dict[str, tuple[str, ...]], size: int = 25) -> Problem:
    """``p`` as a block whose backward reads gradients from later blocks (NOTE [incoming gradients])."""
    return Problem(p.ops, p.values, p.live_out, p.base_bytes, tuple(Incoming(n, size, r) for n, r in readers.items()))


PROBLEMS = {"chain": lambda: chain(7), "diamond": diamond, "unrecomputable": with_unrecomputable}


@pytest.mark.parametrize("name", PROBLEMS)
def test_keep_all_budget_needs_no_recompute(name: str) -> None:
    """At the keep-all peak the schedule recomputes nothing."""
    p = PROBLEMS[name]()
    peak = simulate(p, Schedule.keep_all(p)).peak_bytes
    s = solve_schedule(p, peak)
    assert s is not None and simulate(p, s).recompute_ms == 0


@pytest.mark.parametrize("name", PROBLEMS)
def test_tighter_budget_recomputes_within_budget(name: str) -> None:
    """Below the keep-all peak the schedule fits the budget by recomputing."""
    p = PROBLEMS[name]()
    peak = simulate(p, Schedule.keep_all(p)).peak_bytes
    menu = block_menu(p, n_peak=3, n_kept=3)
    lowest = min(max(o.fwd_peak_bytes, o.bwd_peak_bytes) for o in menu)
    assert lowest < peak, "the problem has no room to trade memory for time"
    s = solve_schedule(p, peak - 1)
    assert s is not None
    sim = simulate(p, s)
    assert sim.peak_bytes <= peak - 1 and sim.recompute_ms > 0


@pytest.mark.parametrize("name", PROBLEMS)
def test_impossible_budget_is_none(name: str) -> None:
    """A budget below what the forward alone needs has no schedule."""
    p = PROBLEMS[name]()
    assert solve_schedule(p, p.base_bytes + 1) is None


def test_kept_budget_is_respected() -> None:
    """A kept budget bounds the simulated kept bytes."""
    p = chain(7)
    big = 10**6
    s = solve_schedule(p, big, kept_budget_bytes=30)
    assert s is not None and simulate(p, s).kept_bytes <= 30


@pytest.mark.parametrize(
    "make",
    [lambda: chain(3), diamond, with_unrecomputable, lambda: chain(3, sizes=[30, 10, 20], times=[1.0, 5.0, 1.0]),
     lambda: with_incoming(chain(3, sizes=[30, 10, 20], times=[1.0, 5.0, 1.0]), {"g3": ("b2",), "h": ("b2", "b1")}),
     lambda: with_incoming(diamond(), {"gout": ("by",)}, size=20)],
)
def test_matches_brute_force(make) -> None:
    """On tiny problems the ILP's recompute time equals exhaustive search at every budget (with gradients from
    later blocks alive until their last read, too)."""
    p = make()
    hi = simulate(p, Schedule.keep_all(p)).peak_bytes
    frontier = brute_force_frontier(p)
    for peak in range(hi, p.base_bytes, -1):
        expected = min((ms for pk, ms in frontier if pk <= peak), default=None)
        s = solve_schedule(p, peak, time_limit_s=10)
        if expected is None:
            assert s is None, f"peak {peak}: ILP found a schedule brute force did not"
            break
        assert s is not None, f"peak {peak}: brute force found {expected} ms, ILP nothing"
        got = simulate(p, s).recompute_ms
        assert got == pytest.approx(expected, rel=0.011), f"peak {peak}"


def test_highs_and_cbc_agree() -> None:
    """Both solver back ends reach the same optimum."""
    if not pulp.HiGHS().available():
        pytest.skip("highspy not installed")
    p = chain(6, times=[1.0, 3.0, 1.0, 2.0, 1.0, 1.0])
    peak = simulate(p, Schedule.keep_all(p)).peak_bytes - 15
    got = {name: solve_schedule(p, peak, solver=name) for name in pulp_backend.SOLVER_NAMES}
    ms = {name: simulate(p, s).recompute_ms for name, s in got.items() if s is not None}
    assert len(ms) == 2 and ms["highs"] == pytest.approx(ms["cbc"])


def test_unknown_solver_is_rejected() -> None:
    """A misspelt solver name says which names work."""
    p = chain(4)
    with pytest.raises(ValueError, match="unknown solver 'gurobi'"):
        solve_schedule(p, 1, solver="gurobi")


@pytest.mark.parametrize("name", PROBLEMS)
def test_block_menu_is_pareto_and_simulated(name: str) -> None:
    """Menu options are mutually non-dominated, include keep-all, and their numbers are the simulator's."""
    p = PROBLEMS[name]()
    menu = block_menu(p, n_peak=4, n_kept=4)
    fwd = len(p.fwd_ops)
    assert any(o.schedule == Schedule.keep_all(p) for o in menu)
    keys = [(o.kept_bytes, o.fwd_peak_bytes, o.bwd_peak_bytes, o.fwd_ms + o.bwd_ms) for o in menu]
    assert len(set(keys)) == len(keys)
    for a, b in itertools.permutations(keys, 2):
        assert not all(x <= y for x, y in zip(a, b)), f"{a} dominates {b}"
    for o in menu:
        sim = simulate(p, o.schedule)
        assert isinstance(o, BlockOption)
        assert o.kept_bytes == sim.kept_bytes
        assert o.fwd_peak_bytes == max(sim.timeline_bytes[:fwd])
        assert o.bwd_peak_bytes == max(sim.timeline_bytes[fwd:])
        assert o.fwd_ms + o.bwd_ms == pytest.approx(sim.time_ms)
    assert min(o.kept_bytes for o in menu) < max(o.kept_bytes for o in menu)


def test_recompute_on_demand_keeps_nothing() -> None:
    """With nothing kept, each backward op recomputes exactly its missing ancestors, once."""
    p = chain(4)
    s = recompute_on_demand(p, frozenset())
    assert s.bwd_sequence == ("f0", "f1", "f2", "f3", "b3", "b2", "b1", "b0")
    assert simulate(p, s).kept_bytes == 0


def test_recompute_on_demand_partial_keep() -> None:
    """Kept values are read from the forward; only the gap is recomputed."""
    p = chain(4)
    s = recompute_on_demand(p, frozenset({"a1"}))
    assert s.bwd_sequence == ("f2", "f3", "b3", "b2", "f0", "b1", "b0")
    sim = simulate(p, s)
    assert sim.kept_bytes == p.value("a1").size_bytes
    assert sim.recompute_ms == pytest.approx(sum(p.op(n).time_ms for n in ("f0", "f2", "f3")))


def test_recompute_on_demand_refuses_unrecomputable() -> None:
    """A needed value of a non-recomputable op must be kept."""
    p = with_unrecomputable()
    with pytest.raises(UnrecomputableValueError, match="op 'f1', which is not recomputable"):
        recompute_on_demand(p, frozenset())
    s = recompute_on_demand(p, frozenset({"a1"}))
    assert "f1" not in s.bwd_sequence


def test_rounded_relaxation_fallback_fits() -> None:
    """The LP-relaxation rounding fallback returns only simulator-checked schedules."""
    from remat_plugin.planning.solvers.ilp import BlockIlp

    p = chain(7)
    peak = simulate(p, Schedule.keep_all(p)).peak_bytes - 10
    ilp = BlockIlp.build(p)
    ilp.set_budgets(peak, None)
    found = ilp._round_relaxation(peak, None, time_limit_s=5)
    assert found is not None
    assert simulate(p, found[0]).peak_bytes <= peak


def test_repeated_solves_reuse_one_model() -> None:
    """Changing budgets on one model gives the same answers as fresh models (no thread/state pitfalls)."""
    from remat_plugin.planning.solvers.ilp import BlockIlp

    p = diamond()
    hi = simulate(p, Schedule.keep_all(p)).peak_bytes
    ilp = BlockIlp.build(p)
    for peak in (hi - 4, hi - 12, hi - 4):
        reused = ilp.solve(peak, None, 5.0)
        fresh = solve_schedule(p, peak)
        assert (reused is None) == (fresh is None)
        if fresh is not None and reused is not None:
            assert simulate(p, reused[0]).recompute_ms == pytest.approx(simulate(p, fresh).recompute_ms, rel=0.011)
