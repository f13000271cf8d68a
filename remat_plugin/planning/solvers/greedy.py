"""Recompute-on-demand: the simplest valid schedule for a given kept set.

Keep the chosen forward values across the forward/backward boundary; before each
backward op, recompute (in forward order) exactly the forward ops whose outputs it
needs and that are not yet available.  A copy, once made, stays readable (the
simulator frees it after its last read), so nothing is recomputed twice.  It is a
baseline, and the repair step that turns a rounded LP solution into a valid schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from remat_plugin.ir.problem import Problem, Schedule


class UnrecomputableValueError(ValueError):
    """The backward phase needs a value whose producer may not be recomputed and which is not kept."""


def forward_values(problem: Problem) -> frozenset[str]:
    """Names of the values forward ops make."""
    return frozenset(v for o in problem.fwd_ops for v in o.outputs)


def must_keep(problem: Problem) -> frozenset[str]:
    """Forward values that cannot be recomputed yet may be read in the backward phase."""
    readers = [o for o in problem.bwd_ops] + [o for o in problem.fwd_ops if o.recomputable]
    read = {v for o in readers for v in o.inputs}
    return frozenset(v for o in problem.fwd_ops if not o.recomputable for v in o.outputs if v in read)


def recompute_on_demand(problem: Problem, kept: frozenset[str]) -> Schedule:
    """Keep ``kept`` (plus ``live_out``) from the forward; recompute missing ancestors right before each backward op."""
    return fill_missing(problem, kept, [()] * len(problem.bwd_ops))


def fill_missing(problem: Problem, kept: frozenset[str], requested: Sequence[Iterable[str]]) -> Schedule:
    """Run ``requested[t]`` forward ops before backward op ``t``, plus any ancestors missing for them or for it.

    Raises :class:`UnrecomputableValueError` if a missing value's producer is not recomputable.
    """
    fwd_values = forward_values(problem)
    available = set(kept & fwd_values) | (problem.live_out & fwd_values)
    fwd_index = {o.name: i for i, o in enumerate(problem.fwd_ops)}
    sequence: list[str] = []
    for bwd_op, wanted in zip(problem.bwd_ops, requested, strict=True):
        stage: set[str] = set()
        for name in wanted:
            _require_op(problem, name, fwd_values, available, stage)
        for v in bwd_op.inputs:
            if v in fwd_values and v not in available:
                _require_op(problem, problem.value(v).producer, fwd_values, available, stage)
        sequence.extend(sorted(stage, key=fwd_index.__getitem__))
        sequence.append(bwd_op.name)
    return Schedule(tuple(sequence))


def _require_op(problem: Problem, name: str, fwd_values: frozenset[str], available: set[str], stage: set[str]) -> None:
    """Add forward op ``name`` and its missing ancestors to ``stage``; mark their outputs available."""
    if name in stage:
        return
    op = problem.op(name)
    if not op.recomputable:
        raise UnrecomputableValueError(
            f"remat_plugin.planning: the backward phase needs outputs {op.outputs} of op {name!r}, which is not "
            "recomputable and not kept; add them to the kept set"
        )
    for v in op.inputs:
        if v in fwd_values and v not in available:
            _require_op(problem, problem.value(v).producer, fwd_values, available, stage)
    stage.add(name)
    available.update(op.outputs)
