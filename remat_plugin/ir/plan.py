"""Planning: blocks → block menus (ILP) → chain DP → one schedule, checked by the simulator.

The chain DP works on rounded, block-local sizes; the schedule it yields is always
re-simulated on the whole graph, and the DP budget is lowered until the simulated peak
fits the user's budget.  So a plan never claims to fit when the simulator says it
does not, and an infeasible budget reports the smallest budget we could reach.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field

from remat_plugin.errors import InfeasibleBudgetError, human_bytes
from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import simulate
from remat_plugin.planning.budget_search import Candidate, fastest_fitting, hill_climb, portfolio, refine
from remat_plugin.planning.menus import Planner, kept_reads
from remat_plugin.planning.solvers.chain import ChainPlan

log = logging.getLogger(__name__)

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class BlockChoice:
    index: int
    n_fwd_ops: int
    mode: str  # "keep" (no recomputation), "recompute" (an ILP option), "checkpoint" (F_none, recomputed from a stored input)
    kept_bytes: int
    recompute_ms: float
    n_recomputed_ops: int = 0  # forward ops of the block run again in the backward (counted once each)


@dataclass(frozen=True)
class Plan:
    """A plan as plain data: what was decided and what it is predicted to cost."""

    budget_bytes: int
    margin_bytes: int  # kept back from the budget for allocator rounding and unseen temporaries
    predicted_peak_bytes: int
    predicted_time_ms: float
    baseline_peak_bytes: int
    baseline_time_ms: float
    min_feasible_bytes: int
    blocks: tuple[BlockChoice, ...]
    n_unique_blocks: int
    planning_s: float = 0.0
    signature: str = ""
    fallback: str | None = None  # why a module-level plan was used instead, if it was
    graph_key: str = ""  # the joint graph's ops (steps.graph_key): a schedule replays only on the same graph
    schema_version: int = PLAN_SCHEMA_VERSION
    schedule: tuple[str, ...] = field(default=(), repr=False)
    # Memory while each op runs (forward ops first), planned and unmodified: filled by `remat plan --json`
    # for `remat report`; empty otherwise, to keep checkpoints small.
    timeline_bytes: tuple[int, ...] = field(default=(), repr=False)
    baseline_timeline_bytes: tuple[int, ...] = field(default=(), repr=False)
    n_fwd_ops: int = 0

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time over the unmodified step time (1.0 = no recomputation)."""
        return self.predicted_time_ms / self.baseline_time_ms if self.baseline_time_ms else 1.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> Plan:
        data = json.loads(text)
        if data.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise ValueError(f"remat_plugin: plan schema {data.get('schema_version')} is not {PLAN_SCHEMA_VERSION}")
        data["blocks"] = tuple(BlockChoice(**b) for b in data["blocks"])
        for name in ("schedule", "timeline_bytes", "baseline_timeline_bytes"):
            data[name] = tuple(data.get(name, ()))
        return Plan(**data)

    def table(self) -> str:
        if self.fallback:
            return f"remat plan  budget {human_bytes(self.budget_bytes)}  FALLBACK: {self.fallback} (budget not verified)"
        floor = human_bytes(self.min_feasible_bytes) if self.min_feasible_bytes >= 0 else "not computed"
        lines = [
            (
                f"remat plan  budget {human_bytes(self.budget_bytes)} (margin {human_bytes(self.margin_bytes)})"
                f"  predicted peak {human_bytes(self.predicted_peak_bytes)}"
                f" (unmodified {human_bytes(self.baseline_peak_bytes)},"
                f" smallest feasible {floor})"
            ),
            (
                f"predicted overhead {self.predicted_overhead:.3f}x  blocks {len(self.blocks)}"
                f" ({self.n_unique_blocks} unique)  planned in {self.planning_s:.1f} s"
            ),
            f"{'block':>5} {'fwd ops':>7} {'mode':>10} {'kept':>12} {'recomputed':>10} {'recompute ms':>12}",
        ]
        for b in self.blocks:
            lines.append(f"{b.index:>5} {b.n_fwd_ops:>7} {b.mode:>10} {human_bytes(b.kept_bytes):>12} "
                         f"{b.n_recomputed_ops:>10} {b.recompute_ms:>12.3f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


MARGIN_MIN_BYTES = 64 * 1024


def safety_margin(budget_bytes: int) -> int:
    """Bytes kept back from a budget for what the model does not see (allocator rounding, tiny temporaries)."""
    return max(MARGIN_MIN_BYTES, budget_bytes // 200)


def budget_for_peak(peak_bytes: int) -> int:
    """The smallest budget whose usable part (budget minus margin) holds ``peak_bytes``."""
    budget = max(peak_bytes + MARGIN_MIN_BYTES, peak_bytes * 200 // 199 - 2)
    while budget - safety_margin(budget) < peak_bytes:
        budget += 1
    return budget


_PLANNERS: dict[tuple, Planner] = {}
_PLANNER_CACHE_SIZE = 8


def _prepared_planner(problem: Problem, constants: set[str], ilp_time_limit_s: float, progress) -> Planner:
    """Blocks and menus depend on the problem, not the budget: reuse them across budgets."""
    key = (problem, frozenset(constants), ilp_time_limit_s)
    planner = _PLANNERS.pop(key, None)
    if planner is None:
        planner = Planner(problem, constants, ilp_time_limit_s)
        planner.prepare(progress)
    _PLANNERS[key] = planner
    while len(_PLANNERS) > _PLANNER_CACHE_SIZE:
        _PLANNERS.pop(next(iter(_PLANNERS)))
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


def _unmodified_plan(problem: Problem, base, user_budget_bytes: int, t0: float) -> Plan:
    """The plan that recomputes nothing, without the block analysis (one block)."""
    n_fwd = len(problem.fwd_ops)
    return Plan(
        budget_bytes=user_budget_bytes, margin_bytes=safety_margin(user_budget_bytes),
        predicted_peak_bytes=base.peak_bytes, predicted_time_ms=base.time_ms,
        baseline_peak_bytes=base.peak_bytes, baseline_time_ms=base.time_ms, min_feasible_bytes=-1,
        blocks=(BlockChoice(0, n_fwd, "keep", base.kept_bytes, 0.0),), n_unique_blocks=1,
        planning_s=time.perf_counter() - t0, schedule=Schedule.keep_all(problem).bwd_sequence,
    )


def make_plan(problem: Problem, constants: set[str], budget_bytes: int, ilp_time_limit_s: float = 0.5,
              progress=None, find_floor: bool = True) -> tuple[Plan, Schedule]:
    """The fastest schedule whose simulated peak fits ``budget_bytes``; raises :class:`InfeasibleBudgetError`.

    ``find_floor=False`` skips the solvers when the unmodified step fits (``min_feasible_bytes``
    is then -1, not computed): a training run with room to spare pays nothing for planning.
    """
    t0 = time.perf_counter()
    user_budget_bytes = budget_bytes
    budget_bytes = user_budget_bytes - safety_margin(user_budget_bytes)
    keep_all = Schedule.keep_all(problem)
    base = simulate(problem, keep_all)
    if not find_floor and base.peak_bytes <= budget_bytes:
        return _unmodified_plan(problem, base, user_budget_bytes, t0), keep_all
    planner = _prepared_planner(problem, constants, ilp_time_limit_s, progress)
    dp_min = planner.min_dp_budget()
    floor = planner.try_budget(dp_min)
    min_feasible = budget_for_peak(min(base.peak_bytes, floor[1].peak_bytes) if floor else base.peak_bytes)
    chosen: Candidate | None = None
    if base.peak_bytes <= budget_bytes:
        chosen = (keep_all, base, None)
    else:
        chosen = fastest_fitting(planner, budget_bytes)
        if chosen is None and floor is not None and floor[1].peak_bytes <= budget_bytes:
            chosen = floor
        if chosen is not None:
            chosen = hill_climb(planner, budget_bytes, refine(planner, budget_bytes, chosen))
        chosen = portfolio(problem, constants, planner, budget_bytes, chosen)
    if chosen is None:
        raise InfeasibleBudgetError(user_budget_bytes, min_feasible)
    schedule, sim, cp = chosen
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
    )
    log.info("remat_plugin: planned %d blocks (%d unique): predicted peak %s of budget %s (margin %s), overhead %.3fx",
             len(blocks), planner.n_unique, human_bytes(sim.peak_bytes), human_bytes(user_budget_bytes),
             human_bytes(plan.margin_bytes),
             plan.predicted_overhead)
    return plan, schedule
