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
"""

from __future__ import annotations

import logging
from functools import cache

import pulp

logger = logging.getLogger(__name__)

THREADS = 1  # the same everywhere: see NOTE [HiGHS pitfalls]
DEFAULT_GAP_REL = 0.01  # accept solutions proved within 1 % of optimal
SOLVER_NAMES = ("highs", "cbc")
_USABLE = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


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
