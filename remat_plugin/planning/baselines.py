"""Classical rematerialization strategies as schedules on a :class:`Problem`, for comparison with our plans.

* :func:`sqrt_n_schedule` — Chen et al.: about sqrt(n) segments of consecutive blocks; only segment
  inputs survive the first forward, and each segment is recomputed just before its backward.
* :func:`rotor_schedule` — pure Rotor: the chain DP of :mod:`remat_plugin.planning.solvers.chain` where each
  block's only option is keep-everything (rk-Rotor without the block ILP menu).
* :func:`checkmate_solve` — Checkmate: the whole-graph ILP of :mod:`remat_plugin.planning.solvers.ilp`.

All three work on the block chain of :func:`remat_plugin.planning.blocks.make_blocks` (the ILP needs none).
A schedule's cost is whatever :func:`remat_plugin.ir.simulate.simulate` says; every budgeted function here
checks the simulated peak before it returns a schedule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import Simulation, simulate, simulate_within
from remat_plugin.planning.blocks import Block, make_blocks
from remat_plugin.planning.budget_search import fastest_fitting
from remat_plugin.planning.menus import Planner
from remat_plugin.planning.solvers import pulp_backend
from remat_plugin.planning.solvers.ilp import BlockIlp, Solution, block_option

__all__ = [
    "CheckmateResult",
    "checkmate_min_peak",
    "checkmate_solve",
    "rotor_planner",
    "rotor_schedule",
    "segmented_schedule",
    "sqrt_n_schedule",
    "sqrt_n_segments",
]


# ------------------------------------------------------------------------------------- sqrt(n)


def sqrt_n_segments(n_blocks: int) -> list[list[int]]:
    """Block indices cut into round(sqrt(n)) contiguous segments whose sizes differ by at most one."""
    if n_blocks <= 0:
        return []
    n_segments = max(1, round(math.sqrt(n_blocks)))
    size, extra = divmod(n_blocks, n_segments)
    segments, start = [], 0
    for i in range(n_segments):
        stop = start + size + (1 if i < extra else 0)
        segments.append(list(range(start, stop)))
        start = stop
    return segments


def _segment_recompute(problem: Problem, fwd_names: list[str], bwd_names: list[str]) -> list[str]:
    """Forward ops of a segment (recomputable, forward order) needed to remake what its backward reads.

    Everything the walk needs from outside the segment (its input, constants, outputs of
    unrecomputable ops) is read from the copy the first forward pass left alive.
    """
    inside = set(fwd_names)
    need = {v for n in bwd_names for v in problem.op(n).inputs}
    chosen: list[str] = []
    for name in reversed(fwd_names):
        op = problem.op(name)
        if op.recomputable and need & set(op.outputs):
            chosen.append(name)
            need.update(op.inputs)
    assert inside.issuperset(chosen)
    return list(reversed(chosen))


def sqrt_n_schedule(problem: Problem, constants: set[str], blocks: list[Block] | None = None) -> Schedule:
    """Chen et al.'s sqrt(n) checkpointing over the block chain.

    Blocks are cut into about sqrt(n) segments of consecutive blocks.  In the backward phase,
    segments run last to first: recompute the segment's forward ops from its stored input
    (only those its backward reads, directly or through other recomputed ops), then run the
    segment's backward ops in problem order with everything it just made alive.  No forward
    value made inside a segment is read before its recomputation, so the first pass keeps
    only the segment inputs (plus constants, unrecomputable outputs and ``live_out`` values).
    """
    blocks = make_blocks(problem, constants) if blocks is None else blocks
    return segmented_schedule(problem, blocks, sqrt_n_segments(len(blocks)))


def segmented_schedule(problem: Problem, blocks: list[Block], segments: list[list[int]]) -> Schedule:
    """Checkpointing by ``segments`` (lists of consecutive block indices covering the chain): the first pass keeps
    only what segment inputs need; each segment is recomputed from its input just before its backward."""
    seq: list[str] = []
    for seg in reversed(segments):
        fwd = [n for i in seg for n in blocks[i].fwd_ops]
        bwd_set = {n for i in seg for n in blocks[i].bwd_ops}
        bwd = [o.name for o in problem.bwd_ops if o.name in bwd_set]
        seq += _segment_recompute(problem, fwd, bwd)
        seq += bwd
    return Schedule(tuple(seq))


# --------------------------------------------------------------------------------------- Rotor


def rotor_planner(problem: Problem, constants: set[str], n_slots: int = 500,
                  blocks: list[Block] | None = None) -> Planner:
    """A :class:`Planner` whose block menus hold only the keep-everything option (pure Rotor).

    Built by hand instead of with ``Planner.prepare`` (which would solve the block ILPs); the
    chain blocks are made by the planner's own ``_chain_block`` so sizes agree with rk-Rotor.
    ``blocks``: the problem's blocks where a planner already made them.
    """
    planner = Planner(problem, constants, n_slots=n_slots)
    planner.blocks = make_blocks(problem, constants) if blocks is None else list(blocks)
    planner.menus = [(block_option(b.problem, Schedule.keep_all(b.problem)),) for b in planner.blocks]
    planner.chain = [planner._chain_block(b, m) for b, m in zip(planner.blocks, planner.menus)]
    planner.n_unique = len({b.key for b in planner.blocks})
    return planner


def _fit_budget(planner: Planner, problem: Problem, budget_bytes: int) -> tuple[Schedule, Simulation] | None:
    """The same search as :func:`remat_plugin.ir.plan.make_plan`: lower the DP budget until the simulator agrees."""
    keep_all = Schedule.keep_all(problem)
    base = simulate(problem, keep_all)
    if base.peak_bytes <= budget_bytes:
        return keep_all, base

    found = fastest_fitting(planner, budget_bytes)
    if found is not None:
        return found[0], found[1]
    floor = planner.try_budget(planner.min_dp_budget())
    if floor is not None and floor[1].peak_bytes <= budget_bytes:
        return floor[0], floor[1]
    return None


def rotor_schedule(
    problem: Problem, constants: set[str], budget_bytes: int, planner: Planner | None = None,
    blocks: list[Block] | None = None,
) -> Schedule | None:
    """Pure Rotor within ``budget_bytes`` (simulated peak), or None when nothing fits.

    ``planner`` (from :func:`rotor_planner`) may be passed to reuse it across budgets; ``blocks``, the
    problem's blocks, to build one without segmenting the graph again.
    """
    planner = rotor_planner(problem, constants, blocks=blocks) if planner is None else planner
    found = _fit_budget(planner, problem, budget_bytes)
    return None if found is None else found[0]


# ------------------------------------------------------------------------------------ Checkmate


@dataclass(frozen=True)
class CheckmateResult:
    schedule: Schedule | None
    optimal: bool  # the MILP solver proved optimality (within ``gap_rel``); False on timeout or LP rounding
    status: str  # "keep_all", "optimal", "feasible" (stopped by the time limit), "rounded" (LP relaxation), "infeasible", "none"
    objective_ms: float | None  # the ILP's recompute time (equals the simulated recompute_ms)
    solution: Solution | None = None  # the integer solution, a warm start for a looser budget


def _gap(gap_rel: float | None) -> float:
    return pulp_backend.DEFAULT_GAP_REL if gap_rel is None else gap_rel


def checkmate_solve(
    problem: Problem,
    budget_bytes: int,
    time_limit_s: float = 60.0,
    *,
    gap_rel: float | None = None,
    solver: str | None = None,
    ilp: BlockIlp | None = None,
    warm: Solution | None = None,
) -> CheckmateResult:
    """The whole-graph ILP at ``budget_bytes`` with its solve status; the schedule, if any, has been checked by the simulator to fit the budget.

    ``gap_rel`` overrides :data:`pulp_backend.DEFAULT_GAP_REL` (1 %) for this solve; 0 asks for a proof of
    optimality.  ``ilp`` (a built ``BlockIlp`` of ``problem``) may be passed to reuse the model; ``warm``: a solution
    that fits this budget (one found at a tighter budget), as the MIP's first incumbent.
    """
    keep_all = Schedule.keep_all(problem)
    if simulate_within(problem, keep_all, budget_bytes) is not None:
        return CheckmateResult(keep_all, True, "keep_all", 0.0)
    ilp = BlockIlp.build(problem, solver) if ilp is None else ilp
    found = ilp.solve(budget_bytes, None, time_limit_s, warm=warm, gap_rel=_gap(gap_rel), to_optimality=True)
    if found is None:
        infeasible = ilp.status == "infeasible"
        return CheckmateResult(None, infeasible, "infeasible" if infeasible else "none", None)
    schedule, solution = found
    if solution is None:  # only the rounded LP relaxation returns no solution
        return CheckmateResult(schedule, False, "rounded", None)
    optimal = ilp.status == "optimal"
    return CheckmateResult(schedule, optimal, "optimal" if optimal else "feasible", ilp.objective_value, solution)


def checkmate_min_peak(
    problem: Problem, time_limit_s: float = 60.0, *, gap_rel: float | None = 0.0, solver: str | None = None
) -> tuple[int, bool]:
    """Least simulated peak the whole-graph ILP reaches (any recompute time), and whether it was proved optimal."""
    ilp = BlockIlp.build(problem, solver)
    big = simulate(problem, Schedule.keep_all(problem)).peak_bytes * 4 + sum(v.size_bytes for v in problem.values) + 1
    found = ilp.solve(big, None, time_limit_s, objective="peak", gap_rel=_gap(gap_rel), to_optimality=True)
    if found is None:
        raise RuntimeError("checkmate_min_peak: the whole-graph ILP found no schedule")
    optimal = found[1] is not None and ilp.status == "optimal"
    return simulate(problem, found[0]).peak_bytes, optimal
