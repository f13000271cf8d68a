"""Choosing a plan: blocks → block menus (ILP) → chain DP → one schedule, checked by the simulator.

The chain DP works on rounded, block-local sizes; the schedule it yields is always
re-simulated on the whole graph, and the DP budget is lowered until the simulated peak
fits the user's budget.  So a plan never claims to fit when the simulator says it
does not, and an infeasible budget reports the smallest budget we could reach.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

from remat_plugin.errors import InfeasibleBudgetError, human_bytes
from remat_plugin.ir.plan import BlockChoice, Plan, budget_for_peak, safety_margin
from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import Simulation, simulate
from remat_plugin.planning.baselines import rotor_schedule, sqrt_n_schedule
from remat_plugin.planning.budget_search import (
    SEARCH_WORK,
    ScheduleCandidate,
    fastest_chained,
    fastest_fitting,
    hill_climb,
    lowest_chained,
    lowest_peak,
)
from remat_plugin.planning.menus import DEFAULT_ILP_TIME_LIMIT_S, Planner, kept_reads
from remat_plugin.planning.solvers.chain import ChainPlan

log = logging.getLogger(__name__)


class PlannerCache:
    """Prepared planners (blocks and menus) by problem: they depend on the problem, not the budget.

    Whoever plans the same problem more than once (another budget, a batch-size search, a
    re-plan) holds one and passes it to :func:`make_plan`; the oldest entries go first.
    """

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._planners: OrderedDict[tuple, Planner] = OrderedDict()
        self.menus: dict[tuple, tuple] = {}  # block structure -> a solved block and its menu (NOTE [menus across shapes])

    def prepared(self, problem: Problem, constants: set[str], ilp_time_limit_s: float, progress=None) -> Planner:
        key = (problem, frozenset(constants), ilp_time_limit_s)
        planner = self._planners.pop(key, None)
        if planner is None:
            planner = Planner(problem, constants, ilp_time_limit_s, solved_elsewhere=self.menus)
            planner.prepare(progress)
        self._planners[key] = planner
        while len(self._planners) > self.max_entries:
            self._planners.popitem(last=False)
        return planner


def _block_choices(planner: Planner, cp: ChainPlan | None, schedule: Schedule) -> tuple[BlockChoice, ...]:
    first_pass: dict[int, str] = {}
    for a in cp.actions if cp is not None else ():
        first_pass.setdefault(a.block, a.kind)
    fwd_names = {o.name for o in planner.problem.fwd_ops}
    kept = kept_reads(planner.problem, schedule)
    recomputed: dict[str, float] = {}
    for n in schedule.bwd_sequence:
        if n in fwd_names:
            recomputed[n] = recomputed.get(n, 0.0) + planner.problem.op(n).time_ms
    choices = []
    for b in planner.blocks:
        ms = sum(recomputed.get(n, 0.0) for n in b.fwd_ops)
        made = {v for n in b.fwd_ops for v in planner.problem.op(n).outputs}
        kept_bytes = sum(planner.problem.value(v).size_bytes for v in kept & made)
        mode = "checkpoint" if first_pass.get(b.index) == "fwd_none" else ("keep" if ms == 0 else "recompute")
        n_again = sum(n in recomputed for n in b.fwd_ops)
        choices.append(BlockChoice(b.index, len(b.fwd_ops), mode, kept_bytes, ms, n_again))
    return tuple(choices)


def _unmodified_plan(problem: Problem, base, user_budget_bytes: int, margin_bytes: int, t0: float) -> Plan:
    """The plan that recomputes nothing, without the block analysis (one block)."""
    n_fwd = len(problem.fwd_ops)
    return Plan(
        budget_bytes=user_budget_bytes, margin_bytes=margin_bytes,
        predicted_peak_bytes=base.peak_bytes, predicted_time_ms=base.time_ms,
        baseline_peak_bytes=base.peak_bytes, baseline_time_ms=base.time_ms, min_feasible_bytes=-1,
        blocks=(BlockChoice(0, n_fwd, "keep", base.kept_bytes, 0.0),), n_unique_blocks=1,
        planning_s=time.perf_counter() - t0, schedule=Schedule.keep_all(problem).bwd_sequence,
    )


def make_plan(problem: Problem, constants: set[str], budget_bytes: int, ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S,
              progress=None, find_floor: bool = True, planners: PlannerCache | None = None,
              calibration_bytes: int = 0) -> tuple[Plan, Schedule]:
    """The fastest schedule whose simulated peak fits ``budget_bytes``; raises :class:`InfeasibleBudgetError`.

    ``find_floor=False`` skips the solvers when the unmodified step fits (``min_feasible_bytes``
    is then -1, not computed): a training run with room to spare pays nothing for planning.
    ``planners`` keeps blocks and menus for the next budget tried on the same problem.
    ``calibration_bytes``: what a metered step showed the model misses, kept back on top of the
    safety margin (NOTE [calibration] in :mod:`remat_plugin.runtime.calibration`).
    """
    t0 = time.perf_counter()
    user_budget_bytes = budget_bytes
    budget_bytes = user_budget_bytes - safety_margin(user_budget_bytes) - calibration_bytes
    keep_all = Schedule.keep_all(problem)
    base = simulate(problem, keep_all)
    if not find_floor and base.peak_bytes <= budget_bytes:
        return _unmodified_plan(problem, base, user_budget_bytes, user_budget_bytes - budget_bytes, t0), keep_all
    t_menus = time.perf_counter()
    planner = (planners or PlannerCache(max_entries=1)).prepared(problem, constants, ilp_time_limit_s, progress)
    t_search = time.perf_counter()
    try:
        return _search(problem, constants, planner, base, keep_all, user_budget_bytes, budget_bytes, calibration_bytes,
                       t0, t_menus, t_search)
    finally:
        planner.end_search()


def _search(problem: Problem, constants: set[str], planner: Planner, base: Simulation, keep_all: Schedule,
            user_budget_bytes: int, budget_bytes: int, calibration_bytes: int, t0: float, t_menus: float,
            t_search: float) -> tuple[Plan, Schedule]:
    """:func:`make_plan`'s search once the menus are ready."""
    floor = lowest_peak(planner)

    def needed(peak_bytes: int) -> int:
        return budget_for_peak(peak_bytes + calibration_bytes)

    min_feasible = needed(min(base.peak_bytes, floor[1].peak_bytes) if floor else base.peak_bytes)
    chosen: ScheduleCandidate | None = None
    if base.peak_bytes <= budget_bytes:
        chosen = (keep_all, base, None)
    else:
        chosen = fastest_fitting(planner, budget_bytes)
        if chosen is not None:
            chosen = hill_climb(planner, budget_bytes, chosen)
        if floor is not None and floor[1].peak_bytes <= budget_bytes:
            # The climb from the lowest-peak schedule can end faster than the one from the DP's pick
            # (the DP rounds sizes; each climb stops at a local optimum).
            chosen = _faster(chosen, hill_climb(planner, budget_bytes, floor, work=SEARCH_WORK // 4))
        for found in planner.fitting(budget_bytes):  # what searches at other budgets found
            chosen = _faster(chosen, found)
        chosen = portfolio(problem, constants, planner, budget_bytes, chosen)
    if chosen is None:
        raise InfeasibleBudgetError(user_budget_bytes, min_feasible)
    min_feasible = min(min_feasible, needed(chosen[1].peak_bytes))
    stages = (("block menus", t_search - t_menus), ("budget search", time.perf_counter() - t_search))
    return _as_plan(planner, base, chosen, user_budget_bytes, budget_bytes, min_feasible, t0, stages), chosen[0]


def _as_plan(planner: Planner, base, chosen: ScheduleCandidate, user_budget_bytes: int, budget_bytes: int,
             min_feasible: int, t0: float, stages: tuple[tuple[str, float], ...]) -> Plan:
    schedule, sim, cp = chosen
    if cp is not None:
        planner.remember((schedule, sim, cp))
        if planner.lowest is None or sim.peak_bytes < planner.lowest[1].peak_bytes:
            planner.lowest = (schedule, sim, cp)  # the search found a lower peak than the DP's least budget
    blocks = _block_choices(planner, cp, schedule)
    plan = Plan(
        budget_bytes=user_budget_bytes,
        margin_bytes=user_budget_bytes - budget_bytes,
        predicted_peak_bytes=sim.peak_bytes,
        predicted_time_ms=sim.time_ms,
        baseline_peak_bytes=base.peak_bytes,
        baseline_time_ms=base.time_ms,
        min_feasible_bytes=min_feasible,
        blocks=blocks,
        n_unique_blocks=planner.n_unique,
        planning_s=time.perf_counter() - t0,
        schedule=schedule.bwd_sequence,
        notes=tuple(planner.notes),
        planning_stages=stages,
        reproducible=not planner.safety_net_hits,
    )
    log.debug("remat_plugin: planned %d blocks (%d unique): predicted peak %s of budget %s (margin %s), overhead %.3fx",
             len(blocks), planner.n_unique, human_bytes(sim.peak_bytes), human_bytes(user_budget_bytes),
             human_bytes(plan.margin_bytes),
             plan.predicted_overhead)
    return plan


def chained_plan(problem: Problem, constants: set[str], calls: int, slack_bytes: int | None = None,
                 lowest: Plan | None = None, ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S,
                 planners: PlannerCache | None = None) -> Plan:
    """For a graph run ``calls`` times in a row in one step, each run's kept bytes alive until its
    backward (an FSDP model's layers): the plan lowest in ``(calls - 1) * kept + peak``
    (:func:`lowest_chained`), or with ``slack_bytes`` and that ``lowest`` plan, the fastest whose
    ``calls * dk + max(0, dw)`` is at most ``slack_bytes`` (``dk``, ``dw``: kept bytes and the rest
    of the peak over ``lowest``'s)."""
    t0 = time.perf_counter()
    base = simulate(problem, Schedule.keep_all(problem))
    planner = (planners or PlannerCache(max_entries=1)).prepared(problem, constants, ilp_time_limit_s)
    t_search = time.perf_counter()
    try:
        chosen = _chained_search(problem, planner, base, calls, slack_bytes, lowest)
    finally:
        planner.end_search()
    budget = budget_for_peak(chosen[1].peak_bytes)
    return _as_plan(planner, base, chosen, budget, budget - safety_margin(budget), budget, t0,
                    (("block menus", t_search - t0), ("budget search", time.perf_counter() - t_search)))


def _chained_search(problem: Problem, planner: Planner, base: Simulation, calls: int, slack_bytes: int | None,
                    lowest: Plan | None) -> ScheduleCandidate:
    """:func:`chained_plan`'s search once the menus are ready."""
    if slack_bytes is None or lowest is None:
        found = lowest_chained(planner, calls)
        chosen: ScheduleCandidate = found if found is not None else (Schedule.keep_all(problem), base, None)
    else:
        low_schedule = Schedule(lowest.schedule)
        low = simulate(problem, low_schedule)

        def fits(sim) -> bool:
            extra_work = (sim.peak_bytes - sim.kept_bytes) - (low.peak_bytes - low.kept_bytes)
            return calls * (sim.kept_bytes - low.kept_bytes) + max(0, extra_work) <= slack_bytes

        start = next((c for c in (planner.lowest, *planner.chosen) if c is not None and c[0] == low_schedule),
                     (low_schedule, low, None))
        chosen = fastest_chained(planner, fits, start)
    return chosen


def _faster(a: ScheduleCandidate | None, b: ScheduleCandidate | None) -> ScheduleCandidate | None:
    if a is None or (b is not None and b[1].time_ms < a[1].time_ms):
        return b
    return a


def portfolio(problem: Problem, constants: set[str], planner: Planner, budget_bytes: int,
              chosen: ScheduleCandidate | None) -> ScheduleCandidate | None:
    """Also weigh the classical schedules (pure Rotor, Chen's sqrt(n)) and keep the fastest that fits.

    Our menus contain Rotor's keep-all option, so in the DP's model we are never worse; the
    DP's rounding can still make it miss a Rotor plan the simulator accepts.  Checking both
    costs one DP and two simulations, and makes "never worse than Rotor or sqrt(n)" a guarantee.
    """
    candidates = [sqrt_n_schedule(problem, constants, planner.blocks)]
    rotor = rotor_schedule(problem, constants, budget_bytes, blocks=planner.blocks)
    if rotor is not None:
        candidates.append(rotor)
    for sched in candidates:
        sim = simulate(problem, sched)
        if sim.peak_bytes <= budget_bytes and (chosen is None or sim.time_ms < chosen[1].time_ms):
            chosen = (sched, sim, None)
    return chosen
