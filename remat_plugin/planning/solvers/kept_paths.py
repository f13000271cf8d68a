"""Block menus from kept sets: two greedy paths through recompute-on-demand schedules.

NOTE [kept paths]
    The block ILP is weak on real layers: HiGHS, capped at a fraction of a second per solve,
    returned incumbents 30-75% above the optimum it later proved, or nothing, at most grid
    points of a gpt2-tiny attention block (964 variables); at 10 s per solve it still had not
    closed them.  A menu solved that way cost 4 s per model and was worse than a simple family:
    keep a set ``K`` of forward values, recompute the rest on demand before each backward op
    (:func:`~remat_plugin.planning.solvers.greedy.recompute_on_demand`).  Its recompute time is
    the summed time of the ops in the closure of what the backward reads and ``K`` lacks, which
    is cheap to compute without the simulator.  Two greedy paths cover the kept-bytes axis:

    * **dropping**: from everything the backward reads, drop one value at a time, the one that
      adds the least recompute time per byte freed;
    * **keeping**: from only what must be kept, keep one value at a time (intermediates
      included: a layer norm's output spares recomputing it for each of its readers), the one
      that saves the most recompute time per byte kept.

    Every point of both paths is simulated (the simulator is the judge of every option, as for
    the ILP's) and the menu is their Pareto set.  On gpt2-tiny and llama-tiny (4 layers) plans
    from these menus predict 1-15% less step time at 0.3-0.7 of the peak than the ILP grid's,
    in 1/4 of the time.  What the family cannot do is recompute a value twice to hold it
    shorter, which the lowest peaks need: the ILP still gives each block its least-peak option
    (:func:`~remat_plugin.planning.solvers.ilp.block_menu` with ``extremes=("peak",)``).
"""
from __future__ import annotations

from collections.abc import Iterator

from remat_plugin.ir.problem import Op, Problem, Schedule
from remat_plugin.planning.solvers.greedy import forward_values, must_keep, recompute_on_demand
from remat_plugin.planning.solvers.ilp import BlockOption, block_option, pareto


class _Closure:
    """Which forward ops recompute-on-demand reruns for a kept set, and their time."""

    def __init__(self, problem: Problem) -> None:
        self.fwd_values = forward_values(problem)
        self.live = problem.live_out
        self.producer: dict[str, Op] = {v: problem.op(problem.value(v).producer) for v in self.fwd_values}
        self.read_back = frozenset(
            v for o in problem.bwd_ops for v in o.inputs if v in self.fwd_values and v not in self.live
        )

    def rerun(self, kept: set[str] | frozenset[str]) -> set[str]:
        """Names of the ops rerun when ``kept`` (and ``live_out``) survive the forward."""
        done: set[str] = set()
        stack = [self.producer[v] for v in self.read_back if v not in kept]
        while stack:
            op = stack.pop()
            if op.name in done:
                continue
            done.add(op.name)
            stack.extend(self.producer[v] for v in op.inputs
                         if v in self.fwd_values and v not in kept and v not in self.live)
        return done


def kept_path_menu(problem: Problem) -> tuple[BlockOption, ...]:
    """Keep-all plus the simulated points of the dropping and keeping paths, Pareto-filtered (NOTE [kept paths])."""
    closure = _Closure(problem)
    forced = must_keep(problem)
    size = {v: max(problem.value(v).size_bytes, 1) for v in closure.fwd_values}
    ms = {o.name: o.time_ms for o in problem.fwd_ops}

    def cost(kept: set[str]) -> float:
        return sum(ms[n] for n in closure.rerun(kept))

    points: list[frozenset[str]] = []
    kept = set(closure.read_back | forced)
    points.append(frozenset(kept))
    now = 0.0
    while kept - forced:  # dropping path
        after = {v: cost(kept - {v}) for v in sorted(kept - forced)}
        v = min(after, key=lambda v: ((after[v] - now) / size[v], v))
        kept.discard(v)
        now = after[v]
        points.append(frozenset(kept))

    kept = set(forced)
    now = cost(kept)
    points.append(frozenset(kept))
    while now > 0:  # keeping path: only outputs of rerun ops can spare time
        rerun = closure.rerun(kept)
        candidates = sorted(v for n in rerun for v in problem.op(n).outputs if v not in closure.live)
        gains = [((now - cost(kept | {v})) / size[v], v) for v in candidates]
        best = max(gains, default=(0.0, ""))
        if best[0] <= 0:
            break
        kept.add(best[1])
        now = cost(kept)
        points.append(frozenset(kept))

    options = [block_option(problem, Schedule.keep_all(problem))]
    options += [block_option(problem, recompute_on_demand(problem, k)) for k in dict.fromkeys(points)]
    return pareto(options)


def single_drop_schedules(problem: Problem) -> Iterator[Schedule]:
    """Recompute-on-demand keeping all the backward reads but one, for each droppable one, made one at a time:
    schedules the menu's Pareto set may lack, for the floor search to try against the whole graph (NOTE
    [options the menus lack])."""
    forced = must_keep(problem)
    kept = _Closure(problem).read_back | forced
    for v in sorted(kept - forced):
        yield recompute_on_demand(problem, kept - {v})
