"""Auto batch size inside a training run: probe the first call, choose, verify with one real step, agree across ranks.

The adapters call :func:`tune_batch_size` with the target module's arguments for the first
batch (recorded by :meth:`RematSession.record_call`, nothing run).  Rank 0 searches
(:func:`~remat_plugin.batch_size.search.choose_batch_size`); every rank then runs the verification
step at the chosen size through the session (which plans it, so the first training step
reuses that plan), the largest peak of all ranks decides, and an over-budget step backs off
one notch.  All ranks end with the same batch size.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

import torch

from remat_plugin.batch_size.search import BatchSizeChoice, batch_dim_size, choose_batch_size, scale_inputs
from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.errors import InfeasibleBudgetError, RematError, human_bytes
from remat_plugin.runtime import dist
from remat_plugin.runtime.session import RematSession
from remat_plugin.runtime.side_effects import unobserved
from remat_plugin.runtime.signature import device_of
from remat_plugin.torch_private import pytree

log = logging.getLogger(__name__)


def _scalar(out: Any) -> torch.Tensor:
    """What to call backward on: a loss if the module returns one, else the sum of its float outputs."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()
              and x.requires_grad]
    if not leaves:
        raise ValueError("remat_plugin.auto_batch: the module's output has no tensor to run backward from")
    return sum(x.sum() for x in leaves)  # type: ignore[return-value]


def measure_step(session: RematSession, args: tuple, kwargs: dict) -> int:
    """Peak of one forward+backward of the session's module on these inputs (planned first if new).

    Buffers, the RNG stream and parameter gradients are left as they were.
    """
    module = session.module
    device = device_of(args, kwargs, module)
    grads = {p: p.grad for p in module.parameters()}
    for p in grads:
        p.grad = None
    with unobserved(module, device), PeakMeter(device if device.type == "cuda" else "cpu") as meter:
        _scalar(module(*args, **kwargs)).backward()
    latest = session.resolver.latest
    if latest is not None:
        latest.take_usage()  # what this step did with the outputs is ours, not the training loop's (NOTE [output usage])
    for p, g in grads.items():
        p.grad = g
    return meter.peak_bytes


_NO_PLAN = 1 << 62  # the "peak" of a size whose verification step finds no plan within the budget


def _measured_or_infeasible(session: RematSession, args: tuple, kwargs: dict) -> int:
    """:func:`measure_step`, or :data:`_NO_PLAN` when the step's own plan does not fit the budget.

    The search judged the size on its own captures; the step captures and plans again, and its block
    menus come from time-limited ILP solves, so right at the boundary its smallest feasible budget can
    come out a little higher.  Every rank then backs off one notch together, as for a step over budget.
    """
    try:
        return measure_step(session, args, kwargs)
    except RematError as err:
        # Under DDP rank 0 plans for all: it raises the InfeasibleBudgetError, the other ranks a RematError
        # that names it (runtime/dist.py); both mean "no plan here", on every rank alike.
        if not dist.failed_with(err, InfeasibleBudgetError):
            raise
        log.info("remat_plugin: %s", err)
        return _NO_PLAN


def tune_batch_size(session: RematSession, args: tuple, kwargs: dict) -> BatchSizeChoice:
    """The batch size for the session's budget, verified by one real step per rank; the same on every rank.

    The objective, ``multiple_of`` and ``max_val`` are those of ``session.config`` (the objective is
    "max" when its ``auto_batch_size`` is off: a direct call asks for a size).
    """
    started = time.perf_counter()
    config = session.config
    objective, multiple_of = str(config.auto_batch_size or "max"), config.multiple_of
    # every rank must decide alike: the smallest budget of all ranks; a failure anywhere stops every rank
    budget = min(dist.gathered(lambda: session.training_budget(args, kwargs), "computing its budget"))
    b1 = batch_dim_size(args, kwargs)

    def search() -> BatchSizeChoice:
        with session.bypassed():  # the search captures the module itself
            return choose_batch_size(session.module, args, kwargs, budget, objective=objective,
                                     multiple_of=multiple_of, max_val=config.max_val,
                                     ilp_time_limit_s=config.ilp_time_limit_s,
                                     planners=session.resolver.caches.planners)

    choice = dist.from_rank_zero(search, "searching the batch size")
    size, trials, peak = choice.batch_size, 0, 0
    while trials < 3:
        step = functools.partial(_measured_or_infeasible, session, *scale_inputs(args, kwargs, b1, size))
        peak = max(dist.gathered(step, f"measuring a step at batch size {size}"))
        trials += 1
        if peak <= budget or size <= multiple_of:
            break
        log.warning("remat_plugin: batch size %d %s the budget %s; backing off to %d", size,
                    "has no plan within" if peak == _NO_PLAN else f"measured {human_bytes(peak)} over",
                    human_bytes(budget), size - multiple_of)
        size -= multiple_of
    return dataclasses.replace(choice, batch_size=size, trial_steps=trials, measured_peak_bytes=peak,
                               search_s=time.perf_counter() - started)
