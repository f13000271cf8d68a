"""Block menus without the ILP, for blocks too big to solve (NOTE [big blocks] in planning.menus)."""

from __future__ import annotations

from collections.abc import Sequence

from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.planning.solvers.greedy import forward_values, must_keep, recompute_on_demand
from remat_plugin.planning.solvers.ilp import BlockOption, block_option, pareto


def greedy_menu(problem: Problem, shares: Sequence[float] = (0.0, 0.25, 0.5, 0.75)
                ) -> tuple[BlockOption, ...]:
    """Options for a block too big for the ILP: keep-all, plus recompute-on-demand keeping the values
    that are dearest to recompute per byte, up to each share of the keepable bytes.

    Every option is costed by the simulator, like the ILP's.
    """
    fwd_values = forward_values(problem)
    read_back = {v for o in problem.bwd_ops for v in o.inputs if v in fwd_values}
    forced = must_keep(problem)
    optional = [v for v in read_back if v not in forced]

    def dearness(v: str) -> float:
        return problem.op(problem.value(v).producer).time_ms / max(problem.value(v).size_bytes, 1)

    optional.sort(key=dearness, reverse=True)
    total = sum(problem.value(v).size_bytes for v in optional)
    options = [block_option(problem, Schedule.keep_all(problem))]
    for share in shares:
        kept, size = set(forced), 0
        for v in optional:
            if size + problem.value(v).size_bytes > share * total:
                break
            kept.add(v)
            size += problem.value(v).size_bytes
        options.append(block_option(problem, recompute_on_demand(problem, frozenset(kept))))
    return pareto(options)
