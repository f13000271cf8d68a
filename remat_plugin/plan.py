"""Planning: blocks → block menus (ILP) → chain DP → one schedule, checked by the simulator.

The chain DP works on rounded, block-local sizes; the schedule it yields is always
re-simulated on the whole graph, and the DP budget is lowered until the simulated peak
fits the user's budget.  So a plan never claims to fit when the simulator says it
does not, and an infeasible budget reports the smallest budget we could reach.
"""
from __future__ import annotations

import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from .blocks import Block, forward_only_peak, make_blocks, rename_schedule
from .errors import InfeasibleBudgetError, human_bytes
from .problem import Problem, Schedule
from .simulate import Simulation, simulate
from .solve.chain import ChainAction, ChainBlock, ChainOption, ChainPlan, min_feasible_budget, solve_chain
from .solve.ilp import BlockOption, block_menu, block_option, solve_schedule

log = logging.getLogger(__name__)

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class BlockChoice:
    index: int
    n_fwd_ops: int
    mode: str  # "keep" (no recomputation), "recompute" (an ILP option), "checkpoint" (F_none, recomputed from a stored input)
    kept_bytes: int
    recompute_ms: float


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
    schema_version: int = PLAN_SCHEMA_VERSION
    schedule: tuple[str, ...] = field(default=(), repr=False)

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
        data["schedule"] = tuple(data["schedule"])
        return Plan(**data)

    def table(self) -> str:
        if self.fallback:
            return f"remat plan  budget {human_bytes(self.budget_bytes)}  FALLBACK: {self.fallback} (budget not verified)"
        lines = [
            (
                f"remat plan  budget {human_bytes(self.budget_bytes)} (margin {human_bytes(self.margin_bytes)})"
                f"  predicted peak {human_bytes(self.predicted_peak_bytes)}"
                f" (unmodified {human_bytes(self.baseline_peak_bytes)},"
                f" smallest feasible {human_bytes(self.min_feasible_bytes)})"
            ),
            (
                f"predicted overhead {self.predicted_overhead:.3f}x  blocks {len(self.blocks)}"
                f" ({self.n_unique_blocks} unique)  planned in {self.planning_s:.1f} s"
            ),
            f"{'block':>5} {'fwd ops':>7} {'mode':>10} {'kept':>12} {'recompute ms':>12}",
        ]
        for b in self.blocks:
            lines.append(f"{b.index:>5} {b.n_fwd_ops:>7} {b.mode:>10} {human_bytes(b.kept_bytes):>12} {b.recompute_ms:>12.3f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _menu_grid(n_ops: int) -> int:
    """Budget grid points per axis: small blocks solve fast, so they get finer menus."""
    return 5 if n_ops <= 40 else 4 if n_ops <= 80 else 3


@dataclass
class Planner:
    """Holds the per-problem work (blocks, menus) so several budgets can be tried cheaply."""

    problem: Problem
    constants: set[str]
    ilp_time_limit_s: float = 0.5
    n_slots: int = 500
    blocks: list[Block] = field(default_factory=list)
    menus: list[tuple[BlockOption, ...]] = field(default_factory=list)
    chain: list[ChainBlock] = field(default_factory=list)
    n_unique: int = 0

    def prepare(self, progress=None) -> None:
        self.blocks = make_blocks(self.problem, self.constants)
        first_of: dict[tuple, Block] = {}
        for b in self.blocks:
            first_of.setdefault(b.key, b)
        self.n_unique = len(first_of)

        def menu_of(b: Block) -> tuple[BlockOption, ...]:
            grid = _menu_grid(len(b.problem.ops))
            return block_menu(b.problem, n_peak=grid, n_kept=grid, time_limit_s=self.ilp_time_limit_s)

        # HiGHS releases the GIL while it solves: unique blocks' menus are solved side by side.
        solved: dict[tuple, tuple[Block, tuple[BlockOption, ...]]] = {}
        workers = max(1, min(len(first_of), os.cpu_count() or 1, 4))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {key: pool.submit(menu_of, b) for key, b in first_of.items()}
            for done, (key, fut) in enumerate(futures.items(), 1):
                solved[key] = (first_of[key], fut.result())
                if progress is not None:
                    progress(done, len(first_of))
        for b in self.blocks:
            src, menu = solved[b.key]
            if src is not b:
                menu = tuple(
                    BlockOption(o.kept_bytes, o.fwd_peak_bytes, o.bwd_peak_bytes, o.fwd_ms, o.bwd_ms,
                                rename_schedule(o.schedule, src.problem, b.problem))
                    for o in menu
                )
            self.menus.append(menu)
        self.chain = [self._chain_block(b, m) for b, m in zip(self.blocks, self.menus)]

    def _chain_block(self, b: Block, menu: tuple[BlockOption, ...]) -> ChainBlock:
        size = (lambda v: self.problem.value(v).size_bytes if v else 0)
        fwd_ms = sum(self.problem.op(n).time_ms for n in b.fwd_ops)
        param_grads = sum(
            self.problem.value(v).size_bytes for n in b.bwd_ops for v in self.problem.op(n).outputs
            if v in self.problem.live_out
        )
        return ChainBlock(
            input_bytes=size(b.input_value),
            output_bytes=size(b.output_value),
            grad_input_bytes=size(b.input_value),
            param_grad_bytes=param_grads,
            none_fwd_ms=fwd_ms,
            none_fwd_peak_bytes=forward_only_peak(b.problem, b.output_value),
            options=tuple(
                ChainOption(o.kept_bytes, o.fwd_peak_bytes, max(0, o.bwd_peak_bytes - o.kept_bytes), o.fwd_ms, o.bwd_ms)
                for o in menu
            ),
        )

    def assemble(self, chain_plan: ChainPlan) -> Schedule:
        """The whole-graph backward sequence realising a chain plan (the first forward pass is implicit)."""
        actions = list(chain_plan.actions)
        first_bwd = next(i for i, a in enumerate(actions) if a.kind == "bwd")
        seq: list[str] = []
        for a in actions[first_bwd:]:
            b = self.blocks[a.block]
            if a.kind == "bwd":
                seq.extend(self.menus[a.block][a.option].schedule.bwd_sequence)
            else:
                wanted = {b.output_value} if b.output_value else set()
                if a.kind == "fwd":
                    wanted |= _kept_reads(b.problem, self.menus[a.block][a.option].schedule)
                seq.extend(_ancestors_in_order(b.problem, wanted))
        return Schedule(tuple(seq))

    def add_option(self, block: Block, option: BlockOption) -> None:
        """Give ``block`` and every block identical to it one more menu option."""
        for b in self.blocks:
            if b.key == block.key:
                renamed = BlockOption(option.kept_bytes, option.fwd_peak_bytes, option.bwd_peak_bytes, option.fwd_ms,
                                      option.bwd_ms, rename_schedule(option.schedule, block.problem, b.problem))
                self.menus[b.index] = (*self.menus[b.index], renamed)
                self.chain[b.index] = self._chain_block(b, self.menus[b.index])

    def try_budget(self, dp_budget: int) -> tuple[Schedule, Simulation, ChainPlan] | None:
        cp = solve_chain(self.chain, dp_budget, self.n_slots)
        if cp is None:
            return None
        sched = self.assemble(cp)
        return sched, simulate(self.problem, sched), cp

    def min_dp_budget(self) -> int:
        return min_feasible_budget(self.chain, self.n_slots)


def _kept_reads(problem: Problem, schedule: Schedule) -> set[str]:
    made: set[str] = set()
    kept: set[str] = set()
    for name in schedule.bwd_sequence:
        op = problem.op(name)
        kept.update(v for v in op.inputs if v not in made)
        made.update(op.outputs)
    fwd_made = {v for o in problem.fwd_ops for v in o.outputs}
    return kept & fwd_made


def _ancestors_in_order(problem: Problem, wanted: set[str]) -> list[str]:
    """Forward ops (recomputable, in order) needed to make ``wanted`` from the block's inputs."""
    need = set(wanted)
    chosen: list[str] = []
    for op in reversed(problem.fwd_ops):
        if need & set(op.outputs) and op.recomputable:
            chosen.append(op.name)
            need.update(op.inputs)
    return list(reversed(chosen))


def _block_choices(planner: Planner, cp: ChainPlan | None, schedule: Schedule) -> tuple[BlockChoice, ...]:
    first_pass: dict[int, str] = {}
    for a in cp.actions if cp is not None else ():
        first_pass.setdefault(a.block, a.kind)
    fwd_names = {o.name for o in planner.problem.fwd_ops}
    kept = _kept_reads(planner.problem, schedule)
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
        choices.append(BlockChoice(b.index, len(b.fwd_ops), mode, kept_bytes, ms))
    return tuple(choices)


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


def fastest_fitting(planner: Planner, budget_bytes: int) -> tuple[Schedule, Simulation, ChainPlan] | None:
    """Try DP budgets around the real one; keep the fastest schedule the simulator says fits.

    The DP rounds sizes up and sees blocks alone, so its own budget is only a knob:
    a little above the real budget often still fits once simulated, and below it the
    overshoot tells how far to step down.
    """
    best = None
    for factor in (1.5, 1.35, 1.25, 1.18, 1.12, 1.08, 1.05, 1.02):
        found = planner.try_budget(int(budget_bytes * factor))
        fits = found is not None and found[1].peak_bytes <= budget_bytes
        if fits and (best is None or found[1].time_ms < best[1].time_ms):
            best = found
    dp_budget = budget_bytes
    for _ in range(12):
        found = planner.try_budget(dp_budget)
        if found is None:
            break
        if found[1].peak_bytes <= budget_bytes:
            if best is None or found[1].time_ms < best[1].time_ms:
                best = found
            break
        dp_budget -= max(found[1].peak_bytes - budget_bytes, budget_bytes // 100)
    return best


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


def _refine(planner: Planner, budget_bytes: int, best, rounds: int = 2):
    """Spend the budget the menus' grid left unused: solve used blocks' ILPs at their share of the slack.

    Menus are solved on a coarse (peak, kept) grid, so the chosen options usually leave
    part of the budget idle.  Each round re-solves every block type the plan recomputes,
    at its option's budgets plus an equal share of the slack, adds what it finds to the
    menus and runs the chain DP again; the simulator still has the last word.
    """
    for _ in range(rounds):
        slack = budget_bytes - best[1].peak_bytes
        chosen = {a.block: a.option for a in best[2].actions if a.kind == "bwd"}
        used: dict[tuple, list[int]] = {}
        for k, o in chosen.items():
            if planner.menus[k][o].bwd_ms > min(x.bwd_ms for x in planner.menus[k]):
                used.setdefault(planner.blocks[k].key, []).append(k)
        if slack <= 0 or not used:
            return best
        added = False
        for ks in used.values():
            block = planner.blocks[ks[0]]
            cur = planner.menus[ks[0]][chosen[ks[0]]]
            share = slack // len(ks)
            peak = max(cur.fwd_peak_bytes, cur.bwd_peak_bytes) + share
            sched = solve_schedule(block.problem, peak, cur.kept_bytes + share, planner.ilp_time_limit_s)
            if sched is not None:
                opt = block_option(block.problem, sched)
                if opt.bwd_ms < cur.bwd_ms:
                    planner.add_option(block, opt)
                    added = True
        if not added:
            return best
        found = fastest_fitting(planner, budget_bytes)
        if found is not None and found[1].time_ms < best[1].time_ms:
            best = found
    return best


def _swap_option(cp: ChainPlan, block: int, option: int) -> ChainPlan:
    actions = tuple(
        ChainAction(a.kind, a.block, option) if a.block == block and a.kind != "fwd_none" else a for a in cp.actions
    )
    return ChainPlan(actions, cp.time_ms, cp.peak_bytes, cp.checkpoints)


def _hill_climb(planner: Planner, budget_bytes: int, best, time_budget_s: float = 2.0):
    """Greedy polish judged by the simulator: move single blocks to faster menu options while the peak fits.

    The chain DP budgets each block with rounded, block-local sizes, so it often leaves
    room that only the whole-graph simulation can see.
    """
    deadline = time.perf_counter() + time_budget_s
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        chosen = {a.block: a.option for a in best[2].actions if a.kind == "bwd"}
        for k, o in chosen.items():
            menu = planner.menus[k]
            faster = sorted((i for i in range(len(menu)) if menu[i].bwd_ms < menu[o].bwd_ms), key=lambda i: menu[i].bwd_ms)
            for i in faster:
                cp = _swap_option(best[2], k, i)
                sched = planner.assemble(cp)
                sim = simulate(planner.problem, sched)
                if sim.peak_bytes <= budget_bytes and sim.time_ms < best[1].time_ms:
                    best, improved = (sched, sim, cp), True
                    break
            if time.perf_counter() > deadline:
                break
    return best


def _portfolio(problem: Problem, constants: set[str], planner: Planner, budget_bytes: int, chosen):
    """Also weigh the classical schedules (pure Rotor, Chen's sqrt(n)) and keep the fastest that fits.

    Our menus contain Rotor's keep-all option, so in the DP's model we are never worse; the
    DP's rounding can still make it miss a Rotor plan the simulator accepts.  Checking both
    costs one DP and two simulations, and makes "never worse than Rotor or sqrt(n)" a guarantee.
    """
    from .solve.baselines import rotor_schedule, sqrt_n_schedule  # baselines build on this module

    candidates = [sqrt_n_schedule(problem, constants, planner.blocks)]
    rotor = rotor_schedule(problem, constants, budget_bytes)
    if rotor is not None:
        candidates.append(rotor)
    for sched in candidates:
        sim = simulate(problem, sched)
        if sim.peak_bytes <= budget_bytes and (chosen is None or sim.time_ms < chosen[1].time_ms):
            chosen = (sched, sim, None)
    return chosen


def make_plan(problem: Problem, constants: set[str], budget_bytes: int, ilp_time_limit_s: float = 0.5,
              progress=None) -> tuple[Plan, Schedule]:
    """The fastest schedule whose simulated peak fits ``budget_bytes``; raises :class:`InfeasibleBudgetError`."""
    t0 = time.perf_counter()
    user_budget_bytes = budget_bytes
    budget_bytes = user_budget_bytes - safety_margin(user_budget_bytes)
    keep_all = Schedule.keep_all(problem)
    base = simulate(problem, keep_all)
    planner = _prepared_planner(problem, constants, ilp_time_limit_s, progress)
    dp_min = planner.min_dp_budget()
    floor = planner.try_budget(dp_min)
    min_feasible = budget_for_peak(min(base.peak_bytes, floor[1].peak_bytes) if floor else base.peak_bytes)
    chosen: tuple[Schedule, Simulation, ChainPlan | None] | None = None
    if base.peak_bytes <= budget_bytes:
        chosen = (keep_all, base, None)
    else:
        chosen = fastest_fitting(planner, budget_bytes)
        if chosen is None and floor is not None and floor[1].peak_bytes <= budget_bytes:
            chosen = floor
        if chosen is not None:
            chosen = _hill_climb(planner, budget_bytes, _refine(planner, budget_bytes, chosen))
        chosen = _portfolio(problem, constants, planner, budget_bytes, chosen)
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
