"""Which MILP solver PuLP runs, and how: HiGHS (through highspy) if present, else CBC.

NOTE [HiGHS pitfalls]
    * HiGHS fixes its thread count process-wide at the first solve; a later solve
      asking for another ``threads`` silently returns "Not Solved".  Every solve here
      passes :data:`THREADS`.
    * A time-limited HiGHS solve reports status "Optimal" whatever it found; only
      ``prob.sol_status`` tells an optimum from an incumbent from nothing, and CBC
      fills in variable values even for infeasible models.  :func:`solve` returns
      whether a usable (optimal or integer-feasible) solution exists; callers must
      still check the schedule it encodes with the simulator.
    * PuLP's HiGHS wrapper has no warm start; :class:`_WarmHiGHS` hands the
      variables' current values to HiGHS as a starting solution.
    * PuLP rebuilds HiGHS's model from its Python objects at every solve: 0.1-0.3 s of
      Python per block ILP of 40K rows, holding the GIL, so threads solving other blocks
      wait.  A block menu solves one model 5-25 times with only two bounds and the
      objective changed: :class:`PersistentHighs` passes the model once and re-solves it.

NOTE [work, not time]
    A solve stopped by a clock returns whatever it had found by then, so the same block gave
    another schedule on a busier machine, and the plan changed with the load.  Every MIP solve
    here stops on counts instead, on one thread, so the same model gives the same answer on any
    machine at any load (models under :data:`MIP_LIMITED_COLUMNS` columns are solved to the gap):
    * :data:`MIP_MAX_IMPROVING_SOLUTIONS` improving solutions (a warm start is one);
    * a number of branch-and-bound nodes that shrinks as the model grows (:func:`max_nodes`);
    * :data:`MIP_MAX_CHECKS` of HiGHS's own limit checks made with a solution in hand
      (:class:`_CheckCount`): the root's cut rounds, which no node limit bounds;
    * above :data:`MIP_LARGE_COLUMNS` columns, the rounded LP relaxation instead of the MIP (its
      root can run a minute between limit checks).
    HiGHS's simplex iteration limit does not bound a MIP's LPs, and its callbacks report no LP
    iterations.  Measured on meta-costed problems at 4 x 512 (ad hoc): a GPT-2 layer's least-peak
    ILP spent 3 s in its root; a Llama layer's warm-started least-recompute ILP (3,668 columns)
    0.36 s a node and 7 s for 5 nodes, 1.7 s with the check limit.  Planning then took
    1.2-4.3 s on gpt2, llama and bert at 0.45 and 0.7 of their peaks, at the same predicted times
    as the 0.25 s-capped solves and floors up to 5% lower.
    The caller's time limit stays as a safety net only: a solve that reaches it says so
    (``Outcome.timed_out``), and the planner marks the plan not reproducible.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import cache

import numpy as np
import pulp

logger = logging.getLogger(__name__)

THREADS = 1  # the same everywhere: see NOTE [HiGHS pitfalls]
MIP_MAX_IMPROVING_SOLUTIONS = 3  # NOTE [work, not time]
MIP_NODE_WORK = 20_000  # branch-and-bound nodes x columns a solve may explore: a node's LP grows with the model
MIP_NODES = (2, 50)  # the fewest and most nodes, whatever the model's size
MIP_MAX_CHECKS = 20  # HiGHS's limit checks with a solution in hand (_CheckCount)
# Smaller models are solved to the gap: quick anyway, and their first solutions can be far from the optimum (a
# 59-column diamond block: 7 ms of recompute at its third solution, 6 at the optimum).
MIP_LIMITED_COLUMNS = 300
# A block ILP this large is answered by its rounded LP relaxation, not the MIP: a 3-layer bidirectional LSTM's
# 16,655-column ILP spent 30-60 s in HiGHS's root, where no limit check comes, before its first solution of least peak.
MIP_LARGE_COLUMNS = 10_000
_HIGHS_NO_LIMIT = 2**31 - 1  # HiGHS's default for both counts
DEFAULT_GAP_REL = 0.01  # accept solutions proved within 1 % of optimal
SOLVER_NAMES = ("highs", "cbc")
_USABLE = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


def _rows_in_order(prob: pulp.LpProblem) -> list[pulp.LpConstraint]:
    """The problem's constraints in the order they were added.  PuLP 3.3 warns that reading ``prob.constraints``
    as a dict goes away in 4.0, where it is a method returning this list; before 3.3 only the dict exists."""
    constraints = prob.constraints
    return list(constraints()) if callable(constraints) else list(constraints.values())


class SolverUnavailableError(RuntimeError):
    """The requested MILP solver is not installed."""


@cache
def default_solver_name() -> str:
    """``"highs"`` when highspy is importable, else ``"cbc"`` (chosen once, logged)."""
    if pulp.HiGHS().available():
        logger.info("remat_plugin.planning: using HiGHS (highspy) for the block ILP")
        return "highs"
    if pulp.PULP_CBC_CMD(msg=False).available():
        logger.info("remat_plugin.planning: highspy not found, using CBC for the block ILP")
        return "cbc"
    raise SolverUnavailableError(
        "remat_plugin.planning: neither HiGHS nor CBC is available to PuLP; install one with `pip install highspy`"
    )


class _WarmHiGHS(pulp.HiGHS):  # type: ignore[misc,valid-type]
    """PuLP's HiGHS interface plus a MIP start taken from the variables' values."""

    def __init__(self, warm_start: bool, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.warm_start = warm_start

    def callSolver(self, lp: pulp.LpProblem) -> None:
        if self.warm_start:
            import highspy

            columns = lp.variables()
            if all(v.varValue is not None for v in columns):
                start = highspy.HighsSolution()
                start.col_value = [float(v.varValue) for v in columns]  # index order: see buildSolverModel
                start.value_valid = True
                lp.solverModel.setSolution(start)
        super().callSolver(lp)


def max_nodes(n_columns: int) -> int:
    """The branch-and-bound nodes a work-limited solve of a model with ``n_columns`` variables may explore."""
    return min(MIP_NODES[1], max(MIP_NODES[0], MIP_NODE_WORK // max(1, n_columns)))


def _counts_apply(work_limited: bool, n_columns: int) -> bool:
    """Whether a solve stops on the counts of NOTE [work, not time]: asked to, and the model is not small."""
    return work_limited and n_columns >= MIP_LIMITED_COLUMNS


def _work_limits(work_limited: bool, n_columns: int) -> dict[str, int]:
    """HiGHS's options for NOTE [work, not time]; without them, its own defaults (no limit)."""
    if not _counts_apply(work_limited, n_columns):
        return {"mip_max_improving_sols": _HIGHS_NO_LIMIT, "mip_max_nodes": _HIGHS_NO_LIMIT}
    return {"mip_max_improving_sols": MIP_MAX_IMPROVING_SOLUTIONS, "mip_max_nodes": max_nodes(n_columns)}


def make_solver(name: str, time_limit_s: float, mip: bool = True, warm_start: bool = False,
                gap_rel: float = DEFAULT_GAP_REL, work_limited: bool = True, n_columns: int = 0) -> pulp.LpSolver:
    """A configured PuLP solver; ``name`` is one of :data:`SOLVER_NAMES`; ``gap_rel`` 0 asks for a proof of optimality;
    ``work_limited``: see :meth:`PersistentHighs.solve`; ``n_columns``: the model's variables (:func:`max_nodes`)."""
    if name == "highs":
        if not pulp.HiGHS().available():
            raise SolverUnavailableError(
                "remat_plugin.planning: HiGHS requested but highspy is not installed; `pip install highspy`"
            )
        return _WarmHiGHS(
            warm_start=warm_start and mip,
            mip=mip,
            msg=False,
            gapRel=gap_rel,
            threads=THREADS,
            timeLimit=time_limit_s,
            **_work_limits(work_limited, n_columns),
        )
    if name == "cbc":
        return pulp.PULP_CBC_CMD(
            mip=mip,
            msg=False,
            gapRel=gap_rel,
            threads=THREADS,
            timeLimit=time_limit_s,
            warmStart=warm_start and mip,
            maxNodes=max_nodes(n_columns) if work_limited else None,
            options=[f"maxSolutions {MIP_MAX_IMPROVING_SOLUTIONS}"] if work_limited else None,
        )
    raise ValueError(f"remat_plugin.planning: unknown solver {name!r}; use one of {SOLVER_NAMES}")


def solve(prob: pulp.LpProblem, name: str, time_limit_s: float, mip: bool = True, warm_start: bool = False,
          gap_rel: float = DEFAULT_GAP_REL, work_limited: bool = True) -> tuple[bool, bool]:
    """Run the solver on ``prob``: (whether it left an optimal or integer-feasible solution in the variables,
    whether it ran into ``time_limit_s``, the safety net of NOTE [work, not time])."""
    started = time.perf_counter()
    try:
        prob.solve(make_solver(name, time_limit_s, mip=mip, warm_start=warm_start, gap_rel=gap_rel,
                               work_limited=work_limited, n_columns=len(prob.variables())))
    except pulp.PulpSolverError as err:
        logger.warning("remat_plugin.planning: %s failed on %s: %s", name, prob.name, err)
        return False, False
    return prob.sol_status in _USABLE, time.perf_counter() - started >= time_limit_s


@dataclass(frozen=True)
class Outcome:
    """What one solve left: ``status`` is "optimal" (within the gap), "feasible" (an incumbent when a work limit or
    the time limit stopped it), "infeasible" (proved) or "none" (no solution, not proved infeasible); ``values``
    by column."""

    status: str
    values: np.ndarray | None
    objective: float | None
    timed_out: bool = False  # stopped by the time limit, the safety net (NOTE [work, not time])


class _CheckCount:
    """HiGHS's MIP interrupt callback: it stops the search at the ``limit``-th limit check made with a solution in
    hand.  HiGHS checks its limits at fixed places of its search (each round of root cuts, each node), so this
    bounds the root's work as the node limit cannot (NOTE [work, not time])."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.seen = limit, 0

    def __call__(self, event) -> None:
        if self.limit is None or event.data_out.mip_primal_bound == float("inf"):
            return
        self.seen += 1
        if self.seen >= self.limit:
            event.data_in.user_interrupt = True


class PersistentHighs:
    """One PuLP problem passed to HiGHS once (columns in ``prob.variables()`` order, rows in constraint order).

    Between solves only the rows named in :meth:`solve` are re-read from the PuLP model
    (their right-hand sides) and the objective is replaced; the PuLP model stays the one
    description of the ILP, and ``writeLP`` still shows it.
    """

    def __init__(self, prob: pulp.LpProblem) -> None:
        import highspy

        self._highspy = highspy
        self.prob = prob
        self.columns = prob.variables()
        self.col_of = {v.name: i for i, v in enumerate(self.columns)}
        self.rows = rows = _rows_in_order(prob)
        self.row_of = {row.name: i for i, row in enumerate(rows) if row.name}
        inf = highspy.kHighsInf
        starts, index, value, lower, upper = [0], [], [], [], []
        for row in rows:
            for var, coef in row.items():
                if coef != 0:
                    index.append(self.col_of[var.name])
                    value.append(coef)
            starts.append(len(index))
            lb, ub = row.getLb(), row.getUb()
            lower.append(-inf if lb is None else lb)
            upper.append(inf if ub is None else ub)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(self.columns), len(lower)
        lp.col_cost_ = np.zeros(len(self.columns))
        lp.col_lower_ = np.array([-inf if v.lowBound is None else v.lowBound for v in self.columns], dtype=float)
        lp.col_upper_ = np.array([inf if v.upBound is None else v.upBound for v in self.columns], dtype=float)
        lp.row_lower_, lp.row_upper_ = np.array(lower, dtype=float), np.array(upper, dtype=float)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = lp.num_col_, lp.num_row_
        lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(value, dtype=float)
        integer, continuous = highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous
        lp.integrality_ = [integer if v.cat == pulp.LpInteger else continuous for v in self.columns]
        self.highs = highspy.Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.setOptionValue("threads", THREADS)
        self.highs.passModel(lp)

    def solve(self, objective: pulp.LpAffineExpression, rows: tuple[str, ...], time_limit_s: float,
              gap_rel: float = DEFAULT_GAP_REL, warm: np.ndarray | None = None, work_limited: bool = True) -> Outcome:
        """Minimise ``objective`` after re-reading the bounds of ``rows``; ``warm``: a MIP start by column;
        ``work_limited``: stop at the counts of NOTE [work, not time] (False: only at the gap or the time limit)."""
        hs, h = self._highspy, self.highs
        for name in rows:
            i = self.row_of[name]
            lb, ub = self.rows[i].getLb(), self.rows[i].getUb()
            h.changeRowBounds(i, -hs.kHighsInf if lb is None else lb, hs.kHighsInf if ub is None else ub)
        cost = np.zeros(len(self.columns))
        for var, coef in objective.items():
            cost[self.col_of[var.name]] = coef
        h.changeColsCost(len(cost), np.arange(len(cost), dtype=np.int32), cost)
        h.setOptionValue("time_limit", float(time_limit_s))
        h.setOptionValue("mip_rel_gap", float(gap_rel))
        for option, limit in _work_limits(work_limited, len(self.columns)).items():
            h.setOptionValue(option, limit)
        h.clearSolver()  # nothing carried over from the last solve but what ``warm`` gives
        if warm is not None:
            start = hs.HighsSolution()
            start.col_value = [float(x) for x in warm]
            start.value_valid = True
            h.setSolution(start)
        checks = _CheckCount(MIP_MAX_CHECKS if _counts_apply(work_limited, len(self.columns)) else None)
        h.cbMipInterrupt.subscribe(checks)
        try:
            h.run()
        finally:
            h.cbMipInterrupt.unsubscribe(checks)
        model_status = h.getModelStatus()
        timed_out = model_status == hs.HighsModelStatus.kTimeLimit
        if model_status in (hs.HighsModelStatus.kInfeasible, hs.HighsModelStatus.kUnboundedOrInfeasible):
            return Outcome("infeasible", None, None)
        info = h.getInfo()
        if info.primal_solution_status != 2:  # 2 = kSolutionStatusFeasible: there is a solution to read
            return Outcome("none", None, None, timed_out)
        values = np.array(h.getSolution().col_value)
        status = "optimal" if model_status == hs.HighsModelStatus.kOptimal else "feasible"
        return Outcome(status, values, info.objective_function_value, timed_out)

    def assign(self, values: np.ndarray) -> None:
        """Write ``values`` into the PuLP variables (``varValue``), as PuLP's own solve would."""
        for var, x in zip(self.columns, values.tolist()):
            var.varValue = x
