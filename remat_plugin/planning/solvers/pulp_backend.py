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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

import numpy as np
import pulp

logger = logging.getLogger(__name__)

THREADS = 1  # the same everywhere: see NOTE [HiGHS pitfalls]
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


def make_solver(name: str, time_limit_s: float, mip: bool = True, warm_start: bool = False,
                gap_rel: float = DEFAULT_GAP_REL) -> pulp.LpSolver:
    """A configured PuLP solver; ``name`` is one of :data:`SOLVER_NAMES`; ``gap_rel`` 0 asks for a proof of optimality."""
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
        )
    if name == "cbc":
        return pulp.PULP_CBC_CMD(
            mip=mip,
            msg=False,
            gapRel=gap_rel,
            threads=THREADS,
            timeLimit=time_limit_s,
            warmStart=warm_start and mip,
        )
    raise ValueError(f"remat_plugin.planning: unknown solver {name!r}; use one of {SOLVER_NAMES}")


def solve(prob: pulp.LpProblem, name: str, time_limit_s: float, mip: bool = True, warm_start: bool = False,
          gap_rel: float = DEFAULT_GAP_REL) -> bool:
    """Run the solver on ``prob``; True iff it left an optimal or integer-feasible solution in the variables."""
    try:
        prob.solve(make_solver(name, time_limit_s, mip=mip, warm_start=warm_start, gap_rel=gap_rel))
    except pulp.PulpSolverError as err:
        logger.warning("remat_plugin.planning: %s failed on %s: %s", name, prob.name, err)
        return False
    return prob.sol_status in _USABLE


@dataclass(frozen=True)
class Outcome:
    """What one solve left: ``status`` is "optimal" (within the gap), "feasible" (an incumbent when time ran
    out), "infeasible" (proved) or "none" (no solution, not proved infeasible); ``values`` by column."""

    status: str
    values: np.ndarray | None
    objective: float | None


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
              gap_rel: float = DEFAULT_GAP_REL, warm: np.ndarray | None = None) -> Outcome:
        """Minimise ``objective`` after re-reading the bounds of ``rows``; ``warm``: a MIP start by column."""
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
        h.clearSolver()  # nothing carried over from the last solve but what ``warm`` gives
        if warm is not None:
            start = hs.HighsSolution()
            start.col_value = [float(x) for x in warm]
            start.value_valid = True
            h.setSolution(start)
        h.run()
        model_status = h.getModelStatus()
        if model_status in (hs.HighsModelStatus.kInfeasible, hs.HighsModelStatus.kUnboundedOrInfeasible):
            return Outcome("infeasible", None, None)
        info = h.getInfo()
        if info.primal_solution_status != 2:  # 2 = kSolutionStatusFeasible: there is a solution to read
            return Outcome("none", None, None)
        values = np.array(h.getSolution().col_value)
        status = "optimal" if model_status == hs.HighsModelStatus.kOptimal else "feasible"
        return Outcome(status, values, info.objective_function_value)

    def assign(self, values: np.ndarray) -> None:
        """Write ``values`` into the PuLP variables (``varValue``), as PuLP's own solve would."""
        for var, x in zip(self.columns, values.tolist()):
            var.varValue = x
