"""Searching the chain DP's budget knob and polishing its plan, with the simulator as judge.

The chain DP rounds sizes up and sees blocks alone, so its own budget is only a knob:
these functions turn it, swap single blocks' options, and weigh the classical schedules,
keeping the fastest schedule whose simulated peak fits.

Every search here is bounded by work, counted in simulated op positions (NOTE [work, not time] in
:mod:`remat_plugin.planning.solvers.pulp_backend`): the same problem gives the same plan at any load.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from remat_plugin.ir.problem import Schedule
from remat_plugin.ir.simulate import Simulation
from remat_plugin.planning.menus import Planner
from remat_plugin.planning.solvers.chain import ChainAction, ChainPlan
from remat_plugin.planning.solvers.ilp import block_option
from remat_plugin.planning.solvers.kept_paths import single_drop_schedules

ScheduleCandidate = tuple[Schedule, Simulation, ChainPlan | None]  # a schedule, its simulation, its chain plan

# A search's allowance, in op positions simulated (Planner.simulated_ops): about 1-2 s of this CPU's simulator on
# a 4-layer GPT-2.  Schedules already simulated in a search cost nothing again.
SEARCH_WORK = 1_000_000
# The wall-clock safety net of one search: reaching it marks the plan not reproducible, with a warning.
SEARCH_SAFETY_NET_S = 60.0


@dataclass
class Allowance:
    """How much more a search may simulate; the clock is only a safety net (NOTE [work, not time])."""

    planner: Planner
    until_ops: int
    deadline: float
    what: str

    @classmethod
    def of(cls, planner: Planner, work: int, what: str, safety_net_s: float = SEARCH_SAFETY_NET_S) -> Allowance:
        return cls(planner, planner.simulated_ops + work, time.perf_counter() + safety_net_s, what)

    def share(self, parts: int) -> Allowance:
        """``1/parts`` of what is left, under the same safety net."""
        left = max(0, self.until_ops - self.planner.simulated_ops)
        return Allowance(self.planner, self.planner.simulated_ops + left // max(1, parts), self.deadline, self.what)

    def spent(self) -> bool:
        if self.planner.simulated_ops >= self.until_ops:
            return True
        if time.perf_counter() > self.deadline:
            self.planner.reached_safety_net(f"the {self.what} reached its wall-clock safety net")
            return True
        return False


def fastest_fitting(planner: Planner, budget_bytes: int) -> tuple[Schedule, Simulation, ChainPlan] | None:
    """Try DP budgets around the real one; keep the fastest schedule the simulator says fits.

    The DP rounds sizes up and sees blocks alone, so its own budget is only a knob:
    a little above the real budget often still fits once simulated, and below it the
    overshoot tells how far to step down.  The knob is turned down from the top to the first
    schedule that fits, then bisected between it and the last that did not: a smaller DP budget
    mostly only shrinks the DP's choices, so its schedules are no faster, and the DP's own peak is
    close to the simulated one (NOTE [outputs in kept sets]), so the first fit can leave a slot's
    rounding per value unused.
    """
    too_big = None
    found = None
    for factor in (1.5, 1.35, 1.25, 1.18, 1.12, 1.08, 1.05, 1.02):
        dp_budget = int(budget_bytes * factor)
        candidate = planner.try_budget(dp_budget)
        if candidate is not None and candidate[1].peak_bytes <= budget_bytes:
            found = (dp_budget, candidate)
            break
        too_big = dp_budget
    if found is None:
        dp_budget = budget_bytes
        for _ in range(12):
            candidate = planner.try_budget(dp_budget)
            if candidate is None:
                return None
            if candidate[1].peak_bytes <= budget_bytes:
                found = (dp_budget, candidate)
                break
            too_big = dp_budget
            dp_budget -= max(candidate[1].peak_bytes - budget_bytes, budget_bytes // 100)
    if found is None:
        return None
    fits_at, best = found
    if too_big is None:  # the first DP budget tried fitted: nothing above it to bisect towards
        return best
    for _ in range(3):  # between the fit and the DP budget above it that did not fit
        middle = (fits_at + too_big) // 2
        candidate = planner.try_budget(middle)
        if candidate is not None and candidate[1].peak_bytes <= budget_bytes:
            fits_at = middle
            if candidate[1].time_ms < best[1].time_ms:
                best = candidate
        else:
            too_big = middle
    return best


def _swap_option(cp: ChainPlan, block: int, option: int) -> ChainPlan:
    actions = tuple(
        ChainAction(a.kind, a.block, option) if a.block == block and a.kind != "fwd_none" else a for a in cp.actions
    )
    return ChainPlan(actions, cp.time_ms, cp.peak_bytes)


def hill_climb(planner: Planner, budget_bytes: int, best, work: int = SEARCH_WORK,
               fits: Callable[[Simulation], bool] | None = None):
    """Greedy polish judged by the simulator: move single blocks to faster menu options while the peak fits.

    The chain DP budgets each block with rounded, block-local sizes, so it often leaves
    room that only the whole-graph simulation can see.  ``fits``: another test than the
    peak within ``budget_bytes`` (:func:`fastest_chained`).
    """
    if fits is None:
        def fits(sim: Simulation) -> bool:
            return sim.peak_bytes <= budget_bytes

    def faster(k: int, o: int) -> list[int]:
        menu = planner.menus[k]
        return sorted((i for i in range(len(menu)) if menu[i].bwd_ms < menu[o].bwd_ms), key=lambda i: menu[i].bwd_ms)

    return _swap_descent(planner, best, _bwd_blocks, faster,
                         lambda sim, incumbent: fits(sim) and sim.time_ms < incumbent.time_ms,
                         Allowance.of(planner, work, "climb to faster options"))


def lowest_peak(planner: Planner, work: int = SEARCH_WORK, n_starts: int = 2):
    """The schedule with the lowest simulated peak we can find: the smallest feasible budget we report.

    The chain DP at its least budget minimises rounded, block-local sizes, which is not the
    whole-graph peak: a few DP budgets just above it, then single-block option swaps judged by
    the simulator (descent on the peak) from the ``n_starts`` lowest of them, often go lower.
    (More than one start: the DP picks the fastest of equally feasible plans, and the lowest peak
    can lie two swaps away from its pick, past a local optimum; on gpt2-tiny, meta costs, one start
    ended 1.6% higher.)  Kept on the planner (``planner.lowest``), so a budget once reported as
    feasible stays so.
    """
    least = planner.min_dp_budget()
    starts: dict[tuple[str, ...], tuple[Schedule, Simulation, ChainPlan]] = {}
    for factor in (1.0, 1.01, 1.03, 1.06):
        found = planner.try_budget(int(least * factor))
        if found is not None:
            starts.setdefault(found[0].bwd_sequence, found)
    if planner.lowest is not None:
        starts.setdefault(planner.lowest[0].bwd_sequence, planner.lowest)
    if not starts:
        return None
    allowance = Allowance.of(planner, work, "floor search")
    ordered = sorted(starts.values(), key=lambda c: c[1].peak_bytes)[:n_starts]
    best = None
    for i, start in enumerate(ordered):
        found = _descend_peak(planner, start, allowance.share(len(ordered) - i + 1))  # the widening gets a share
        if best is None or found[1].peak_bytes < best[1].peak_bytes:
            best = found
    assert best is not None
    best = _widen_at_peak(planner, best, allowance)
    planner.lowest = best
    return best


# NOTE [holding blocks at the peak]
#     At the simulated peak one block runs and the blocks before it hold their kept sets until their
#     backward.  Giving a holding block an option that keeps more bytes adds them at that moment, so the new
#     peak is no lower: the floor descent offers a holding block only options that keep fewer bytes, and the
#     running block every option.  (The bytes are the block's own: a value it keeps that the graph holds
#     anyway changes nothing at the peak, so a skipped swap could in principle still lower it.)  On a
#     16-layer llama-tiny the descent then converged within its share of the search (then a 2 s clock, now
#     SEARCH_WORK) instead of running into it: its floor search took 0.7-1.3 s instead of 2.0-2.3 s and ended
#     0.06-0.6% lower, in four captures; the floors
#     of the bench models (gpt2-tiny at 4 and 12 layers in four captures, bert, llama, t5, mixtral, mlp-chain,
#     resnet) were the same or lower (ad hoc, 2026-11-30, the machine in its slow state; README "Planning time").
def _descend_peak(planner: Planner, best: tuple[Schedule, Simulation, ChainPlan],
                  allowance: Allowance) -> tuple[Schedule, Simulation, ChainPlan]:
    """Single-block option swaps kept while the simulated peak falls, over the blocks at the peak
    (NOTE [holding blocks at the peak])."""
    running: list[int | None] = [None]  # the block running at the incumbent's peak, read once per pass

    def blocks(c: tuple[Schedule, Simulation, ChainPlan]) -> list[int]:
        running[0], at_peak = planner.running_at_peak(c[2], c[1])
        return at_peak

    def options(k: int, o: int) -> list[int]:
        menu = planner.menus[k]
        if running[0] is None or k == running[0]:
            return [i for i in range(len(menu)) if i != o]
        return [i for i in range(len(menu)) if menu[i].kept_bytes < menu[o].kept_bytes]

    return _swap_descent(planner, best, blocks, options,
                         lambda sim, incumbent: sim.peak_bytes < incumbent.peak_bytes, allowance)


# NOTE [options the menus lack]
#     A block's menu is its Pareto set judged alone: the blocks around it enter only through the chain
#     DP's bookkeeping (x, δ, kept sets, side charges), so an option that is no lower alone can still
#     lower the whole graph's peak (on bert-tiny, meta costs, the floor search ends 4.5% lower with
#     them).  So the floor search also tries, for the blocks at the peak, "keep all the backward reads
#     but one" options outside their menus, judged by the simulator on the whole graph, and adds to the
#     menus those that lower the peak.  (The case that showed it first, mlp-chain's floor hanging on
#     measured op times, was the menus not counting the gradients later blocks hand a block: NOTE
#     [incoming gradients].)
def _widen_at_peak(planner: Planner, best: tuple[Schedule, Simulation, ChainPlan],
                   allowance: Allowance) -> tuple[Schedule, Simulation, ChainPlan]:
    """Options outside the menus (:func:`single_drop_schedules`) for the blocks at the peak, each kept where the
    whole-graph peak falls, then another descent (NOTE [options the menus lack])."""
    tried: set[tuple[int, Schedule]] = set()
    while True:
        found: tuple[Schedule, Simulation, ChainPlan] | None = None
        for k in planner.blocks_at_peak(best[2], best[1]):
            block = planner.blocks[k]
            known = {o.schedule for o in planner.menus[k]}
            for schedule in single_drop_schedules(block.problem):
                if allowance.spent():
                    return best
                if schedule in known or (k, schedule) in tried:
                    continue
                tried.add((k, schedule))
                index = planner.add_option(block, block_option(block.problem, schedule))
                cp = _swap_option(best[2], k, index)
                sched, sim = planner.evaluate(cp)
                if sim.peak_bytes < best[1].peak_bytes:
                    found = (sched, sim, cp)
                    break
                planner.drop_last_option(block)
            if found is not None:
                break
        if found is None:
            return best
        best = _descend_peak(planner, found, allowance)


def lowest_chained(planner: Planner, calls: int, work: int = SEARCH_WORK) -> ScheduleCandidate | None:
    """The schedule lowest in ``(calls - 1) * kept + peak`` (then fastest): the step's peak when ``calls``
    copies of this graph run one after another, as the layers of an FSDP model do (NOTE [FSDP2 budget]).

    Each copy's kept bytes stay alive until its backward, so a plan that keeps less can beat the
    lowest-peak one.  Candidates: the DP at budgets from its least to twice that, the plans made so
    far, then single-block option swaps judged by the simulator, as in :func:`lowest_peak`.
    """
    def cost(sim: Simulation) -> tuple[int, float]:
        return (calls - 1) * sim.kept_bytes + sim.peak_bytes, sim.time_ms

    least = planner.min_dp_budget()
    found = [planner.try_budget(int(least * (1 + k / 8))) for k in range(9)]
    starts = [c for c in (*found, planner.lowest, *planner.chosen) if c is not None and c[2] is not None]
    if not starts:
        return None
    best = min(starts, key=lambda c: cost(c[1]))
    return _descend(planner, best, cost, _bwd_blocks, Allowance.of(planner, work, "chained descent"))


def _descend(planner: Planner, best, cost: Callable[[Simulation], object], blocks: Callable, allowance: Allowance):
    """Single-block option swaps judged by the simulator, kept while ``cost`` falls: every other option of each of
    ``blocks(best)``."""
    def others(k: int, o: int) -> list[int]:
        return [i for i in range(len(planner.menus[k])) if i != o]

    return _swap_descent(planner, best, blocks, others,
                         lambda sim, incumbent: cost(sim) < cost(incumbent),  # type: ignore[operator]
                         allowance)


def _bwd_blocks(candidate: ScheduleCandidate) -> list[int]:
    """The blocks a candidate's chain plan runs a backward of, in its order."""
    assert candidate[2] is not None
    return [a.block for a in candidate[2].actions if a.kind == "bwd"]


def _swap_descent(planner: Planner, best, blocks: Callable, options: Callable[[int, int], list[int]],
                  better: Callable[[Simulation, Simulation], bool], allowance: Allowance):
    """The swap loop of :func:`hill_climb` and :func:`_descend`: each pass tries, for each of ``blocks(best)``, its
    ``options(block, chosen option)`` in order, keeps the first swap whose simulation is ``better`` than the
    incumbent's and moves on to the next block; passes repeat until one gains nothing or the allowance is spent
    (checked after each block, so a pass is cut at the same place on any machine)."""
    improved = True
    while improved and not allowance.spent():
        improved = False
        chosen = {a.block: a.option for a in best[2].actions if a.kind == "bwd"}
        for k in blocks(best):
            for i in options(k, chosen[k]):
                cp = _swap_option(best[2], k, i)
                sched, sim = planner.evaluate(cp)
                if better(sim, best[1]):
                    best, improved = (sched, sim, cp), True
                    break
            if allowance.spent():
                break
    return best


def fastest_chained(planner: Planner, fits: Callable[[Simulation], bool], start: ScheduleCandidate,
                    work: int = SEARCH_WORK) -> ScheduleCandidate:
    """The fastest schedule ``fits`` accepts, ``start`` (accepted) if none is faster: a test on kept bytes
    and peak together, as a chain of FSDP units needs (NOTE [FSDP2 budget]), which no single DP budget
    expresses.  Candidates: the DP at budgets from its least to 4x that, then :func:`hill_climb`."""
    best = start
    least = planner.min_dp_budget()
    for k in range(17):
        found = planner.try_budget(int(least * 2 ** (k / 8)))
        if found is not None and fits(found[1]) and found[1].time_ms < best[1].time_ms:
            best = found
    return hill_climb(planner, 0, best, work, fits=fits) if best[2] is not None else best
