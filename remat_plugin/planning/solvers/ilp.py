"""Block ILP (rk-Checkmate): the least recompute time for one block's backward phase within memory budgets.

The forward phase is fixed (NOTE [schedule model] in :mod:`remat_plugin.ir.problem`); the
ILP has one stage ``t`` per backward op ``b_t`` (in ``Problem.ops`` order).  Stage ``t``
runs any recomputable forward ops, in forward order, then ``b_t``.  Indices: forward op
``j`` (position ``j`` of a stage; ``b_t`` sits at position ``F``), tracked value ``v`` (a
forward value outside ``live_out``), ``p(v)`` its producer, ``s_v`` its size, ``X[t,c]`` the
"runs" indicator of position ``c`` (``R[t,c]``, or 1 for ``b_t``)::

    variables   R[t,j] ∈ {0,1}        recompute forward op j in stage t
                S[t,v] ∈ {0,1}        a copy of v is alive when stage t starts; S[0,·] is the kept set
                FREE[t,v,c] ∈ [0,1]   the copy of v dies right after position c of stage t
                U[t,c] ≥ 0            bytes of tracked values while position c of stage t runs
                M, K ≥ 0              peak bytes, kept bytes

    minimize    Σ_t Σ_j time_j · R[t,j]
    subject to
      fwd_dep     R[t,j] ≤ R[t,p(v)] + S[t,v]                          ∀ v ∈ in(j)
      bwd_dep     1 ≤ R[t,p(v)] + S[t,v]                               ∀ v ∈ in(b_t)
      retain      S[t+1,v] ≤ S[t,v] + R[t,p(v)]
      free        FREE[t,v,c] ≤ X[t,c],  FREE[t,v,c] ≤ 1 − S[t+1,v],
                  FREE[t,v,c] ≤ 1 − X[t,c']   ∀ later candidates c'   (candidates: p(v) and v's readers)
      mem_bwd     U[t,c] = U[t,c⁻] − Σ_v s_v FREE[t,v,c⁻] + out_bytes_c X[t,c]   (U before the first c: Σ_v s_v S[t,v])
                  U[t,c] + temp_c X[t,c] + other_bytes[t,c] ≤ M
      mem_fwd     fwd_bytes[i] + Σ_{v: p(v) ≤ i, v's forward reads end before i} s_v S[0,v] ≤ M
      kept        K = Σ_v s_v S[0,v]
      peak_budget M ≤ peak budget;   kept_budget K ≤ kept budget

``other_bytes`` (base, forward ``live_out`` values, gradients alive around ``b_t``, incoming gradients up to
their last reader) and ``fwd_bytes`` (values alive in the forward anyway) are constants: backward ops never
rerun.

NOTE [ILP memory is an upper bound]
    Every copy the simulator holds at a stage boundary is read later with no recompute
    in between, which the dep/retain rows force into S; FREE only falls at a copy's
    true last read (or at birth), and with FREE continuous the optimiser may leave a
    free out but never invent one.  So the ILP's memory is at least the simulated one,
    and equals it when S is minimal (which an optimum can always choose).  Keeping a
    copy and recomputing it in the same stage is counted twice: wasteful, but safe.
    The solver's claim is still never trusted: :meth:`BlockIlp.solve` re-simulates.

Pruning: ``R[t,j]`` exists only for ops whose outputs can reach a backward op ≥ t;
``S[t,v]`` only for values some op at stage ≥ t may read; missing ones are 0.  Forward
ops making a ``live_out`` value are not recomputed (the value stays alive anyway).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pulp

from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import Simulation, simulate, simulate_within
from remat_plugin.planning.solvers import pulp_backend
from remat_plugin.planning.solvers.greedy import UnrecomputableValueError, fill_missing, must_keep, recompute_on_demand

logger = logging.getLogger(__name__)

__all__ = ["BlockOption", "block_menu", "recompute_on_demand", "solve_schedule"]


@dataclass(frozen=True)
class BlockOption:
    """One schedule of a block with its simulated costs."""

    kept_bytes: int  # forward values alive across the fwd/bwd boundary
    fwd_peak_bytes: int  # max of the simulated timeline over forward positions
    bwd_peak_bytes: int  # max of the simulated timeline over backward positions
    fwd_ms: float  # sum of forward op times
    bwd_ms: float  # backward op times + recomputation times
    schedule: Schedule


Solution = np.ndarray  # an accepted integer solution: the value of each column of BlockIlp.columns


class BlockIlp:
    """The PuLP model of one problem, built once; budgets change only two right-hand sides."""

    def __init__(self, problem: Problem, solver: str) -> None:
        self.problem = problem
        self.solver = solver
        self.prob = pulp.LpProblem("block_ilp", pulp.LpMinimize)
        self.R: list[dict[int, pulp.LpVariable]] = []
        self.S: list[dict[str, pulp.LpVariable]] = []
        self.FREE: list[dict[str, dict[int, pulp.LpVariable]]] = []
        self.recompute_ms = pulp.LpAffineExpression()
        self.peak = self.prob.add_variable("peak_units", lowBound=0)
        self.kept = self.prob.add_variable("kept_units", lowBound=0)
        self.columns: list[pulp.LpVariable] = []  # the variables in one fixed order (a Solution's order)
        self.status = "none"  # the last solve's outcome: see pulp_backend.Outcome
        self.timed_out = False  # some solve reached its time limit, the safety net (NOTE [work, not time])
        self.objective_value: float | None = None
        self._highs: pulp_backend.PersistentHighs | None = None

    # ----------------------------------------------------------------- build
    @classmethod
    def build(cls, problem: Problem, solver: str | None = None) -> BlockIlp:
        ilp = cls(problem, solver or pulp_backend.default_solver_name())
        ilp._index()
        ilp._add_variables()
        ilp._add_fwd_dep()
        ilp._add_bwd_dep()
        ilp._add_retain()
        ilp._add_free()
        ilp._add_mem_bwd()
        ilp._add_mem_fwd()
        ilp._add_kept()
        ilp.prob += ilp.peak <= 0, "peak_budget"  # right-hand sides set per solve: set_budgets
        ilp.prob += ilp.kept <= 0, "kept_budget"
        ilp.prob.setObjective(ilp.recompute_ms)
        ilp.columns = ilp.prob.variables()
        return ilp

    def _index(self) -> None:
        pb = self.problem
        self.fwd = pb.fwd_ops
        self.bwd = pb.bwd_ops
        self.pos = {o.name: i for i, o in enumerate(self.fwd)}
        fwd_values = [v for o in self.fwd for v in o.outputs]
        self.tracked = [v for v in fwd_values if v not in pb.live_out]
        self.vid = {v: k for k, v in enumerate(self.tracked)}  # short index for variable/row names
        self.unit_bytes = (
            max([pb.value(v).size_bytes for v in pb.live_out | set(fwd_values)] + [o.temp_bytes for o in pb.ops] + [1])
            / 1024
        )
        self.size = {v: pb.value(v).size_bytes / self.unit_bytes for v in self.tracked}
        self.producer = {v: self.pos[pb.value(v).producer] for v in fwd_values}
        can_rerun = [o.recomputable and not set(o.outputs) & pb.live_out for o in self.fwd]
        ancestors: list[set[int]] = []
        for j, op in enumerate(self.fwd):
            ancestors.append({j}.union(*(ancestors[self.producer[v]] for v in op.inputs if v in self.producer)))
        T = len(self.bwd)
        self.useful: list[set[int]] = [set() for _ in range(T + 1)]
        self.readable: list[set[str]] = [set() for _ in range(T + 1)]
        for t in reversed(range(T)):
            read = {v for v in self.bwd[t].inputs if v in self.size}
            self.useful[t] = self.useful[t + 1] | {j for v in read for j in ancestors[self.producer[v]] if can_rerun[j]}
            self.readable[t] = (
                self.readable[t + 1] | read | {v for j in self.useful[t] for v in self.fwd[j].inputs if v in self.size}
            )

    def _add_variables(self) -> None:
        for t in range(len(self.bwd)):
            self.R.append({j: self.prob.add_variable(f"R_{t}_{j}", cat=pulp.LpBinary) for j in sorted(self.useful[t])})
            self.S.append(
                {
                    v: self.prob.add_variable(f"S_{t}_{k}", cat=pulp.LpBinary)
                    for k, v in enumerate(self.tracked)
                    if v in self.readable[t]
                }
            )
            self.recompute_ms += pulp.lpSum(self.fwd[j].time_ms * r for j, r in self.R[t].items())

    def _r(self, t: int, j: int) -> pulp.LpVariable | int:
        return self.R[t].get(j, 0)

    def _s(self, t: int, v: str) -> pulp.LpVariable | int:
        return self.S[t].get(v, 0) if t < len(self.S) else 0

    # ------------------------------------------------------- constraint families
    def _add_fwd_dep(self) -> None:
        """fwd_dep: a recomputed op finds each input kept or recomputed earlier in the stage."""
        for t, R_t in enumerate(self.R):
            for j, r in R_t.items():
                for v in self.fwd[j].inputs:
                    if v in self.size:
                        self.prob += (
                            r <= self._r(t, self.producer[v]) + self._s(t, v),
                            f"fwd_dep_{t}_{j}_{self.vid[v]}",
                        )

    def _add_bwd_dep(self) -> None:
        """bwd_dep: backward op t finds each forward input kept or recomputed in stage t."""
        for t, op in enumerate(self.bwd):
            for v in op.inputs:
                if v in self.size:
                    self.prob += (
                        self._r(t, self.producer[v]) + self._s(t, v) >= 1,
                        f"bwd_dep_{t}_{self.vid[v]}",
                    )

    def _add_retain(self) -> None:
        """retain: a copy alive at stage t+1 was alive at stage t or made in it."""
        for t in range(len(self.bwd) - 1):
            for v, s_next in self.S[t + 1].items():
                self.prob += (
                    s_next <= self._s(t, v) + self._r(t, self.producer[v]),
                    f"retain_{t}_{self.vid[v]}",
                )

    def _candidates(self, t: int, v: str) -> list[int]:
        """Positions of stage t after which v's copy may die: its producer and its readers."""
        c = [j for j in self.R[t] if j == self.producer[v] or v in self.fwd[j].inputs]
        return c + [len(self.fwd)] if v in self.bwd[t].inputs else c

    def _x(self, t: int, c: int) -> pulp.LpVariable | int:
        return 1 if c == len(self.fwd) else self.R[t][c]

    def _add_free(self) -> None:
        """free: v dies after position c only if c runs, no later candidate runs and v is not retained."""
        for t in range(len(self.bwd)):
            self.FREE.append({})
            for k, v in enumerate(self.tracked):
                cands = self._candidates(t, v)
                if not cands or (v not in self.S[t] and self.producer[v] not in self.R[t]):
                    continue
                self.FREE[t][v] = {}
                for i, c in enumerate(cands):
                    f = self.FREE[t][v][c] = self.prob.add_variable(f"FREE_{t}_{k}_{c}", lowBound=0, upBound=1)
                    if c != len(self.fwd):
                        self.prob += f <= self._x(t, c), f"free_runs_{t}_{k}_{c}"
                    if isinstance(self._s(t + 1, v), pulp.LpVariable):
                        self.prob += f <= 1 - self._s(t + 1, v), f"free_unretained_{t}_{k}_{c}"
                    for later in cands[i + 1 :]:
                        self.prob += f <= 1 - self._x(t, later), f"free_last_{t}_{k}_{c}_{later}"

    def _bwd_other_bytes(self) -> tuple[list[int], list[int]]:
        """Bytes besides tracked values between b_{t-1} and b_t, and while b_t runs (gradients never rerun)."""
        pb, T = self.problem, len(self.bwd)
        const = pb.base_bytes + sum(pb.value(v).size_bytes for v in pb.live_out if v in self.producer)
        between, during = [const] * T, [const] * T
        for s, op in enumerate(self.bwd):
            for w in op.outputs:
                readers = [t for t, o in enumerate(self.bwd) if w in o.inputs]
                death = T - 1 if w in pb.live_out else max(readers, default=s)
                assert all(r > s for r in readers), (
                    f"backward value {w!r} read before op {op.name!r} (position {s}) makes it"
                )
                for t in range(s, death + 1):
                    during[t] += pb.value(w).size_bytes
                    if t > s:
                        between[t] += pb.value(w).size_bytes
        position = {op.name: t for t, op in enumerate(self.bwd)}
        for g in pb.incoming:  # alive from the first stage to its last reader's
            for t in range(max((position[r] for r in g.readers), default=-1) + 1):
                between[t] += g.size_bytes
                during[t] += g.size_bytes
        return between, during

    def _add_mem_bwd(self) -> None:
        """mem_bwd: U[t,c] runs over the positions of stage t; each running position stays within M."""
        between, during = self._bwd_other_bytes()
        F = len(self.fwd)
        for t in range(len(self.bwd)):
            prev: pulp.LpAffineExpression = pulp.lpSum(self.size[v] * s for v, s in self.S[t].items())
            prev_c = None
            for c in [*self.R[t], F]:
                u = self.prob.add_variable(f"U_{t}_{c}", lowBound=0)
                freed = [self.size[v] * fc[prev_c] for v, fc in self.FREE[t].items() if prev_c in fc]  # type: ignore[index]
                made = sum(self.size.get(v, 0) for v in self.fwd[c].outputs) if c < F else 0
                self.prob += u == prev - pulp.lpSum(freed) + made * self._x(t, c), f"mem_bwd_flow_{t}_{c}"
                temp, other = (self.fwd[c].temp_bytes, between[t]) if c < F else (self.bwd[t].temp_bytes, during[t])
                self.prob += (
                    u + temp / self.unit_bytes * self._x(t, c) + other / self.unit_bytes <= self.peak,
                    f"mem_bwd_{t}_{c}",
                )
                prev, prev_c = u, c

    def _add_mem_fwd(self) -> None:
        """mem_fwd: while forward op i runs, values still read in the forward, live_out or kept are alive."""
        pb = self.problem
        last_read = dict(self.producer)
        for i, op in enumerate(self.fwd):
            for v in op.inputs:
                if v in last_read:
                    last_read[v] = i
        for i, op in enumerate(self.fwd):
            fixed = (
                pb.base_bytes
                + op.temp_bytes
                + sum(
                    pb.value(v).size_bytes
                    for v, p in self.producer.items()
                    if p <= i and (i <= last_read[v] or v in pb.live_out)
                )
            )
            kept = (
                [self.size[v] * s for v, s in self.S[0].items() if self.producer[v] <= i and last_read[v] < i]
                if self.S
                else []
            )
            self.prob += fixed / self.unit_bytes + pulp.lpSum(kept) <= self.peak, f"mem_fwd_{i}"

    def _add_kept(self) -> None:
        """kept: K is the bytes of forward values alive across the boundary."""
        kept = pulp.lpSum(self.size[v] * s for v, s in self.S[0].items()) if self.S else 0
        self.prob += self.kept == kept, "kept"

    # ----------------------------------------------------------------- solve
    def set_budgets(self, peak_budget_bytes: float, kept_budget_bytes: float | None) -> None:
        """Change only the budget rows' right-hand sides (the model is not rebuilt)."""
        self._row("peak_budget").changeRHS(peak_budget_bytes / self.unit_bytes)
        kept_cap = sum(self.size.values()) + 1 if kept_budget_bytes is None else kept_budget_bytes / self.unit_bytes
        self._row("kept_budget").changeRHS(kept_cap)

    def _row(self, name: str) -> pulp.LpConstraint:
        row = self.prob.get_constraint_by_name(name)
        assert row is not None, name
        return row

    def schedule_from_values(self) -> Schedule:
        """The schedule R encodes: each stage's recomputations in forward order, then its backward op."""
        seq: list[str] = []
        for t, op in enumerate(self.bwd):
            seq += [self.fwd[j].name for j, r in sorted(self.R[t].items()) if (r.varValue or 0) > 0.5]
            seq.append(op.name)
        return Schedule(tuple(seq))

    def solve(
        self,
        peak_budget_bytes: int,
        kept_budget_bytes: int | None,
        time_limit_s: float,
        warm: Solution | None = None,
        objective: str = "recompute",
        gap_rel: float = pulp_backend.DEFAULT_GAP_REL,
        to_optimality: bool = False,
    ) -> tuple[Schedule, Solution | None] | None:
        """A simulator-checked schedule within the budgets (ILP, else rounded LP relaxation), or None.

        ``gap_rel``: the MILP relative gap accepted as optimal (0 asks for a proof of optimality).
        ``to_optimality``: search until the gap or the time limit, not only the planner's counts of work
        (NOTE [work, not time]); for the baselines that measure how far a plan is from the optimum.
        """
        self.set_budgets(peak_budget_bytes, kept_budget_bytes)
        goal = {"recompute": self.recompute_ms, "peak": self.peak + 0, "kept": self.kept + 0}[objective]
        if not to_optimality and len(self.columns) >= pulp_backend.MIP_LARGE_COLUMNS:
            self.prob.setObjective(goal)  # NOTE [work, not time]: the rounded LP relaxation only
            self.status = "none"
            return self._round_relaxation(peak_budget_bytes, kept_budget_bytes, time_limit_s)
        if self._run(goal, time_limit_s, warm, gap_rel, not to_optimality):
            schedule = self.schedule_from_values()
            if simulate_within(self.problem, schedule, peak_budget_bytes, kept_budget_bytes) is not None:
                return schedule, np.round([v.varValue or 0.0 for v in self.columns])
            logger.warning(
                "remat_plugin.planning: ILP solution failed the simulator check (peak budget %d B)", peak_budget_bytes
            )
        if self.status == "infeasible":
            return None
        return self._round_relaxation(peak_budget_bytes, kept_budget_bytes, time_limit_s)

    def _run(self, goal: pulp.LpAffineExpression, time_limit_s: float, warm: Solution | None, gap_rel: float,
             work_limited: bool) -> bool:
        """One MILP solve; True iff the variables now hold an optimal or integer-feasible solution."""
        self.prob.setObjective(goal)  # also the objective of a later _round_relaxation
        if self.solver == "highs":
            if self._highs is None:
                self._highs = pulp_backend.PersistentHighs(self.prob)
                assert self._highs.columns == self.columns
            outcome = self._highs.solve(goal, ("peak_budget", "kept_budget"), time_limit_s, gap_rel, warm,
                                        work_limited)
            self.status, self.objective_value = outcome.status, outcome.objective
            self.timed_out |= outcome.timed_out
            if outcome.values is not None:
                self._highs.assign(outcome.values)
            return outcome.values is not None
        if warm is not None:
            for var, x in zip(self.columns, warm.tolist()):
                var.varValue = x
        usable, timed_out = pulp_backend.solve(self.prob, self.solver, time_limit_s, warm_start=warm is not None,
                                               gap_rel=gap_rel, work_limited=work_limited)
        self.timed_out |= timed_out
        self.status = ("optimal" if self.prob.sol_status == pulp.LpSolutionOptimal else "feasible") if usable else (
            "infeasible" if self.prob.status == pulp.LpStatusInfeasible else "none")
        self.objective_value = pulp.value(goal) if usable else None
        return usable

    def _round_relaxation(
        self, peak_budget_bytes: int, kept_budget_bytes: int | None, time_limit_s: float
    ) -> tuple[Schedule, Solution | None] | None:
        """Checkmate's fallback: solve the LP relaxation, round R and S[0], repair by recompute-on-demand."""
        usable, timed_out = pulp_backend.solve(self.prob, self.solver, time_limit_s, mip=False)
        self.timed_out |= timed_out
        if not usable:
            return None
        forced = must_keep(self.problem)
        candidates = []
        for threshold in (0.5, 0.1, 0.9):
            kept = (
                frozenset(v for v, s in self.S[0].items() if (s.varValue or 0) >= threshold) | forced
                if self.S
                else forced
            )
            requested = [[self.fwd[j].name for j, r in R_t.items() if (r.varValue or 0) >= 0.5] for R_t in self.R]
            nothing: list[list[str]] = [[] for _ in self.R]
            for req in (requested, nothing):
                try:
                    candidates.append(fill_missing(self.problem, kept, req))
                except UnrecomputableValueError:
                    continue
        fitting = [
            (sim.recompute_ms, s)
            for s in candidates
            if (sim := simulate_within(self.problem, s, peak_budget_bytes, kept_budget_bytes))
        ]
        if not fitting:
            return None
        logger.info("remat_plugin.planning: using a rounded LP relaxation (the MILP found no integer solution)")
        return min(fitting, key=lambda x: x[0])[1], None


def solve_schedule(
    problem: Problem,
    peak_budget_bytes: int,
    kept_budget_bytes: int | None = None,
    time_limit_s: float = 5.0,
    *,
    solver: str | None = None,
    ilp: BlockIlp | None = None,
) -> Schedule | None:
    """Least-recompute-time schedule within the budgets, or None if infeasible / not solved in time.

    None comes only after the LP-relaxation rounding fallback also failed the simulator check.

    ``solver`` is ``"highs"`` or ``"cbc"``; by default HiGHS when installed.  ``ilp``: the model of
    ``problem`` built earlier (building it costs about as much as solving it once).
    """
    keep_all = Schedule.keep_all(problem)
    if simulate_within(problem, keep_all, peak_budget_bytes, kept_budget_bytes) is not None:
        return keep_all  # no recomputation: optimal
    ilp = ilp if ilp is not None and ilp.problem is problem else BlockIlp.build(problem, solver)
    found = ilp.solve(peak_budget_bytes, kept_budget_bytes, time_limit_s)
    return None if found is None else found[0]


def block_option(problem: Problem, schedule: Schedule) -> BlockOption:
    """The :class:`BlockOption` of ``schedule``, every number from the simulator."""
    sim = simulate(problem, schedule)
    n_fwd = len(problem.fwd_ops)
    fwd_ms = sum(o.time_ms for o in problem.fwd_ops)
    return BlockOption(
        kept_bytes=sim.kept_bytes,
        fwd_peak_bytes=max(sim.timeline_bytes[:n_fwd], default=problem.base_bytes),
        bwd_peak_bytes=max(sim.timeline_bytes[n_fwd:], default=problem.base_bytes),
        fwd_ms=fwd_ms,
        bwd_ms=sim.time_ms - fwd_ms,
        schedule=schedule,
    )


def pareto(options: Iterable[BlockOption]) -> tuple[BlockOption, ...]:
    """Options not dominated in (kept, fwd peak, bwd peak, total time), without duplicates, fastest first."""

    def key(o: BlockOption) -> tuple[float, ...]:
        return (o.kept_bytes, o.fwd_peak_bytes, o.bwd_peak_bytes, o.fwd_ms + o.bwd_ms)

    unique = {key(o): o for o in reversed(list(options))}  # first of equal-cost options wins
    kept = [o for k, o in unique.items() if not any(k2 != k and all(a <= b for a, b in zip(k2, k)) for k2 in unique)]
    return tuple(sorted(kept, key=lambda o: (o.fwd_ms + o.bwd_ms, o.kept_bytes)))


@dataclass(frozen=True)
class _Found:
    """A schedule block_menu found, and the budgets (peak, kept) under which it is the ILP's answer."""

    schedule: Schedule
    sim: Simulation
    region: tuple[int, int] | None  # None: not a least-recompute answer (only a warm start)
    solution: Solution | None  # None: no integer solution to warm-start from

    def fits(self, peak_bytes: int, kept_bytes: int) -> bool:
        return self.sim.peak_bytes <= peak_bytes and self.sim.kept_bytes <= kept_bytes

    def settles(self, peak_bytes: int, kept_bytes: int) -> bool:
        """Still the answer at tighter budgets it fits: a smaller feasible set cannot do better."""
        return (
            self.region is not None
            and self.fits(peak_bytes, kept_bytes)
            and peak_bytes <= self.region[0]
            and kept_bytes <= self.region[1]
        )


def _grid(lo: int, hi: int, n: int) -> list[int]:
    if n <= 1 or hi <= lo:
        return [hi]
    return sorted({round(lo + (hi - lo) * i / (n - 1)) for i in range(n)})


def block_menu(
    problem: Problem,
    n_peak: int = 6,
    n_kept: int = 6,
    time_limit_s: float = 5.0,
    *,
    solver: str | None = None,
    ilp: BlockIlp | None = None,
    extremes: tuple[str, ...] = ("kept", "peak"),
) -> tuple[BlockOption, ...]:
    """Pareto menu over a grid of (peak budget, kept budget) pairs.

    Always includes the keep-everything schedule (Schedule.keep_all) and, per name in ``extremes``, the
    least-kept-memory or least-peak schedule found (then the least recompute at that kept size or peak).
    With ``n_peak = n_kept = 1`` the grid is keep-all's point alone, so only the extremes are solved.
    The grid spans from the least peak / kept found to the keep-all values; one model is built and only the
    budget rows change between grid points, visited loose to tight.  Every number comes from the simulator.
    """
    keep_all = Schedule.keep_all(problem)
    sim_all = simulate(problem, keep_all)
    ilp = ilp if ilp is not None and ilp.problem is problem else BlockIlp.build(problem, solver)
    big = sim_all.peak_bytes * 4 + sum(v.size_bytes for v in problem.values) + 1  # no budget
    found = [_Found(keep_all, sim_all, (big, big), None)]  # keep-all is optimal wherever it fits
    for objective in extremes:  # the grid's low ends, then the least recompute there
        extreme = ilp.solve(big, None, time_limit_s, objective=objective)
        if extreme is None:
            continue
        sim = simulate(problem, extreme[0])
        region = (big, sim.kept_bytes) if objective == "kept" else (sim.peak_bytes, big)
        cheaper = ilp.solve(*region, time_limit_s, warm=extreme[1])
        found.append(
            _Found(
                *(cheaper or extreme)[:1],
                simulate(problem, (cheaper or extreme)[0]),
                region if cheaper else None,
                (cheaper or extreme)[1],
            )
        )
    peaks = _grid(min(f.sim.peak_bytes for f in found), sim_all.peak_bytes, n_peak)
    kepts = _grid(min(f.sim.kept_bytes for f in found), sim_all.kept_bytes, n_kept)
    infeasible: list[tuple[int, int]] = []
    for peak in reversed(peaks):  # loose to tight, so earlier answers settle later points
        for kept in reversed(kepts):
            if any(peak <= p and kept <= k for p, k in infeasible) or any(f.settles(peak, kept) for f in found):
                continue
            fitting = [f for f in found if f.fits(peak, kept) and f.solution is not None]
            warm = min(fitting, key=lambda f: f.sim.recompute_ms).solution if fitting else None
            answer = ilp.solve(peak, kept, time_limit_s, warm=warm)
            if answer is None:
                if ilp.status == "infeasible":
                    infeasible.append((peak, kept))
                continue
            found.append(_Found(answer[0], simulate(problem, answer[0]), (peak, kept), answer[1]))
    return pareto(block_option(problem, f.schedule) for f in found)
