"""Auto batch size: the largest batch whose best plan fits the budget, found by planning instead of crashing.

Trial-and-error finders (Lightning's ``BatchSizeFinder``, Accelerate's
``find_executable_batch_size``) run steps until one runs out of memory.  We have a memory
model, so: capture the step at the first batch size ``b1`` and at ``2 b1`` (no step runs:
:func:`~remat_plugin.runtime.steps.capture_problem` stops at the problem) and read every
value's size and op's time as a line in the batch size (parameters and their gradients do
not grow, activations do; two points measure that instead of assuming it).  The problem at
any batch size ``b`` is then known without running it (:func:`interpolate`), and the
smallest budget any plan reaches there (the planner's floor) says whether ``b`` fits.  A
linear guess of the boundary is checked, then walked one ``multiple_of`` at a time until
``b`` fits and ``b + multiple_of`` does not.  One real step at the chosen size verifies it;
if the meter disagrees, the search backs off one notch.

Sizes are planned as training's first plan runs them.  The search runs before any step has shown
what the loop does with the outputs; where the module returns one floating scalar (the loss) beside
other tensors (the logits), a first plan that does not fit with every output differentiated steps
down to holding the others without a gradient (NOTE [loss-only first plan] in
:mod:`remat_plugin.runtime.resolver`), so the search captures that step.  A loop that then
differentiates those outputs at the chosen size is refused (``InfeasibleBudgetError``, naming the
budget it needs), never run over the budget.  A loop that drops them (``.loss`` kept) re-plans at
its second step with them freed (NOTE [output usage]), below the chosen size's plan.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from remat_plugin.errors import InfeasibleBudgetError, RematError, human_bytes
from remat_plugin.ir.problem import Op, Problem, Value
from remat_plugin.planning.choose_plan import PlannerCache, make_plan
from remat_plugin.planning.menus import DEFAULT_ILP_TIME_LIMIT_S
from remat_plugin.runtime.steps import captured_problem
from remat_plugin.torch_private import pytree

log = logging.getLogger(__name__)

OBJECTIVES = ("max", "throughput")


class BatchScalingError(RematError):
    """The step's graph changes with the batch size, so sizes cannot be read as lines in it."""


@dataclass(frozen=True)
class Candidate:
    batch_size: int
    min_feasible_bytes: int  # the planner's floor at this size (a fitting plan may go a little below it)
    predicted_time_ms: float | None  # of the best plan under the budget; None if it does not fit
    predicted_peak_bytes: int | None = None  # of that plan

    @property
    def samples_per_s(self) -> float:
        return self.batch_size / self.predicted_time_ms * 1e3 if self.predicted_time_ms else 0.0


@dataclass(frozen=True)
class BatchSizeChoice:
    batch_size: int
    objective: str
    budget_bytes: int
    chosen: Candidate
    next_size: Candidate | None  # batch_size + multiple_of: does not fit (None when max_val stops the search)
    evaluated: tuple[Candidate, ...]
    trial_steps: int  # real steps run to verify
    measured_peak_bytes: int | None
    search_s: float = 0.0  # wall time of the search and its verification steps (set by the runtime's tuner)
    ungraded_outputs: tuple[int, ...] = ()  # flat tensor outputs the sizes were planned to give no gradient

    def summary(self) -> str:
        nxt = (f"; {self.next_size.batch_size} would need {human_bytes(self.next_size.min_feasible_bytes)}"
               if self.next_size else "")
        measured = f", measured {human_bytes(self.measured_peak_bytes)}" if self.measured_peak_bytes else ""
        peak = self.chosen.predicted_peak_bytes
        loss_only = (f"; planned with output(s) {list(self.ungraded_outputs)} held without a gradient (only the "
                     "loss differentiated)" if self.ungraded_outputs else "")
        return (f"batch size {self.batch_size} ({self.objective}): its best plan fits {human_bytes(self.budget_bytes)}"
                f" (predicted {human_bytes(peak) if peak is not None else '?'}{measured}){nxt}{loss_only}; "
                f"{len(self.evaluated)} sizes planned, {self.trial_steps} real step(s)")


def batch_dim_size(args: tuple, kwargs: dict) -> int:
    """The batch size of a call: the most common leading dimension of its tensor inputs."""
    sizes = [x.shape[0] for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.ndim]
    if not sizes:
        raise BatchScalingError("remat_plugin.batch_size: the call has no tensor input with a batch dimension")
    return max(set(sizes), key=sizes.count)


def scale_inputs(args: tuple, kwargs: dict, b_from: int, b_to: int) -> tuple[tuple, dict]:
    """The call with every tensor whose dim 0 is ``b_from`` repeated or cut to ``b_to`` rows."""

    def scale(x):
        if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == b_from:
            reps = math.ceil(b_to / b_from)
            return x.repeat(reps, *([1] * (x.ndim - 1)))[:b_to].clone().requires_grad_(x.requires_grad)
        return x

    new_args, new_kwargs = pytree.tree_map(scale, (args, kwargs))
    return tuple(new_args), dict(new_kwargs)


def interpolate(p1: Problem, b1: int, p2: Problem, b2: int, b: int) -> Problem:
    """The problem at batch size ``b``, each size and time on the line through ``(b1, p1)`` and ``(b2, p2)``."""
    if [o.name for o in p1.ops] != [o.name for o in p2.ops] or [v.name for v in p1.values] != [
            v.name for v in p2.values]:
        raise BatchScalingError(f"remat_plugin.batch_size: the graph at batch {b2} differs from the one at {b1}; "
                                "the batch size changes the model's code path, so it cannot be planned by size")
    t = (b - b1) / (b2 - b1)

    def line(y1: float, y2: float) -> float:
        return max(0.0, y1 + (y2 - y1) * t)

    values = tuple(Value(v.name, math.ceil(line(v.size_bytes, w.size_bytes)), v.producer)
                   for v, w in zip(p1.values, p2.values))
    ops = tuple(Op(o.name, o.is_fwd, o.inputs, o.outputs, line(o.time_ms, q.time_ms),
                   math.ceil(line(o.temp_bytes, q.temp_bytes)), o.recomputable) for o, q in zip(p1.ops, p2.ops))
    return Problem(ops, values, p1.live_out, math.ceil(line(p1.base_bytes, p2.base_bytes)))


class BatchSizeSearch:
    """Plans ``module`` at candidate batch sizes from two captured points; see the module docstring."""

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, budget_bytes: int, *, multiple_of: int = 1,
                 max_val: int | None = None, ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S,
                 planners: PlannerCache | None = None):
        if multiple_of < 1 or (max_val is not None and max_val < multiple_of):
            raise ValueError(f"remat_plugin.batch_size: need 1 <= multiple_of ({multiple_of}) <= max_val ({max_val})")
        self.budget_bytes = budget_bytes
        self.multiple_of, self.max_val = multiple_of, max_val
        self.ilp_time_limit_s = ilp_time_limit_s
        self.b1 = batch_dim_size(args, kwargs)
        self.b2 = 2 * self.b1
        # Planned as training's first plan runs each size: the outputs beside the loss, if any, held without a
        # gradient when no plan fits with them differentiated (module docstring).
        first = captured_problem(module, args, kwargs, ungrade_beside_the_loss=True)
        self.p1, self.constants, self.ungraded_outputs = first.problem, first.constants, first.ungraded_outputs
        a2, k2 = scale_inputs(args, kwargs, self.b1, self.b2)
        second = captured_problem(module, a2, k2, ungrade_beside_the_loss=True)
        if second.ungraded_outputs != self.ungraded_outputs:
            raise BatchScalingError(f"remat_plugin.batch_size: the step's outputs differ between batch sizes {self.b1} "
                                    f"and {self.b2}, so sizes cannot be read as lines in the batch size")
        self.p2 = second.problem
        self.cache: dict[int, Candidate] = {}
        # Block menus are solved at the first size tried and re-costed at the others (NOTE [menus across
        # shapes]); given the runtime's cache, the plan of the chosen size takes them too.
        self.planners = planners if planners is not None else PlannerCache()

    def evaluate(self, b: int) -> Candidate:
        """Plan batch size ``b`` (from the two captured points) under the budget."""
        if b not in self.cache:
            problem = interpolate(self.p1, self.b1, self.p2, self.b2, b)
            try:
                plan, _ = make_plan(problem, self.constants, self.budget_bytes, self.ilp_time_limit_s,
                                    planners=self.planners)
                self.cache[b] = Candidate(b, plan.min_feasible_bytes, plan.predicted_time_ms, plan.predicted_peak_bytes)
            except InfeasibleBudgetError as exc:
                self.cache[b] = Candidate(b, exc.min_feasible_bytes, None)
            log.info("remat_plugin.batch_size: batch %d needs at least %s", b,
                     human_bytes(self.cache[b].min_feasible_bytes))
        return self.cache[b]

    def _notch(self, b: float) -> int:
        b = max(self.multiple_of, int(b) // self.multiple_of * self.multiple_of)
        return min(b, self.max_val // self.multiple_of * self.multiple_of) if self.max_val else b

    def largest_fitting(self) -> tuple[Candidate, Candidate | None]:
        """The largest fitting size and the next notch (which does not fit), or raise if none fits."""
        m1, m2 = self.evaluate(self.b1).min_feasible_bytes, self.evaluate(self.b2).min_feasible_bytes
        slope = max(1.0, (m2 - m1) / (self.b2 - self.b1))
        b = self._notch(self.b1 + (self.budget_bytes - m1) / slope)
        step = self.multiple_of
        while self.evaluate(b).predicted_time_ms is None:
            if b <= self.multiple_of:
                raise InfeasibleBudgetError(self.budget_bytes, self.evaluate(b).min_feasible_bytes,
                                            what=f"forward+backward at batch size {b}")
            b = self._notch(b - step)
        while self.max_val is None or b + step <= self.max_val:
            if self.evaluate(b + step).predicted_time_ms is None:
                return self.evaluate(b), self.evaluate(b + step)
            b += step
        return self.evaluate(b), None

    def fastest(self, largest: int) -> Candidate:
        """Among sizes up to ``largest``, the one with the most predicted samples per second."""
        sizes = {largest, self._notch(largest * 3 / 4), self._notch(largest / 2), self._notch(largest / 4)}
        return max((self.evaluate(b) for b in sorted(sizes)), key=lambda c: c.samples_per_s)


def choose_batch_size(module: nn.Module, args: tuple, kwargs: dict, budget_bytes: int, *, objective: str = "max",
                      multiple_of: int = 1, max_val: int | None = None, ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S,
                      verify: Callable[[int], int] | None = None, max_trials: int = 3,
                      planners: PlannerCache | None = None) -> BatchSizeChoice:
    """The batch size for ``budget_bytes``; ``verify(b)`` runs one real step at ``b`` and returns its peak.

    ``planners``: the runtime's prepared planners and menus, so the chosen size's own plan reuses the search's.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"remat_plugin.batch_size: objective {objective!r} is not one of {OBJECTIVES}")
    search = BatchSizeSearch(module, args, kwargs, budget_bytes, multiple_of=multiple_of, max_val=max_val,
                             ilp_time_limit_s=ilp_time_limit_s, planners=planners)
    chosen, nxt = search.largest_fitting()
    if objective == "throughput":
        chosen = search.fastest(chosen.batch_size)
    trials, measured = 0, None
    while verify is not None and trials < max_trials:
        measured = verify(chosen.batch_size)
        trials += 1
        if measured <= budget_bytes:
            break
        log.warning("remat_plugin.batch_size: batch %d measured %s over the budget %s; backing off one notch",
                    chosen.batch_size, human_bytes(measured), human_bytes(budget_bytes))
        nxt = chosen
        chosen = search.evaluate(search._notch(chosen.batch_size - multiple_of))
    return BatchSizeChoice(chosen.batch_size, objective, budget_bytes, chosen, nxt,
                           tuple(sorted(search.cache.values(), key=lambda c: c.batch_size)), trials, measured,
                           ungraded_outputs=tuple(sorted(search.ungraded_outputs)))
