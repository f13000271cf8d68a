"""The benchmark: our plan at several budgets against the peers, on one model's own parameters.

For each model, in one process:

1. The unmodified step (``none``) is measured with the meter; its peak defines the budget bytes
   of every fraction (``budget_bytes = int(fraction * none_peak)``).
2. Each strategy (``none``, ``per_layer``, ``sqrt_n``, ``ours@<fraction>``) runs one metered step,
   which gives its measured peak and, from the same step, its parameter gradients; those are
   compared with ``none``'s (same batch, same RNG seed, so dropout draws the same masks).
3. Its step time is compared with ``none`` as a ratio: after a warm-up pair, ``pairs`` times one
   ``none`` step then one strategy step (each repeated up to ``MIN_TIMING_S`` when a step is that
   short), the ratio of each pair, and the median of those (CPU times are noisy, ratios of
   interleaved steps less so).

Our plan is made once per budget (planning is the slow part) and that module is reused for all of
its measurements. A budget below the smallest feasible one becomes an ``infeasible`` row.

Every row is a plain dict (JSON-ready); ``bench/report.py`` formats them.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from remat_plugin.bench.models import BenchModel, build
from remat_plugin.bench.peers import EAGER_PEERS, Step, applicable_peers
from remat_plugin.capture.memory_meter import PeakMeter, measure_peak_profiler
from remat_plugin.errors import InfeasibleBudgetError, RematError
from remat_plugin.runtime.module import RematModule, rematerialize
from remat_plugin.runtime.side_effects import unobserved

__all__ = ["RUN_PEERS", "BenchRow", "run_bench", "run_model", "time_ratios"]

log = logging.getLogger(__name__)

BenchRow = dict[str, Any]
Batch = tuple[tuple[Any, ...], dict[str, Any]]

# The eager peers (bench/peers.py's EAGER_PEERS) this benchmark measures, in report order; drop_cheap is compare's.
RUN_PEERS = ("none", "per_layer", "sqrt_n")
# The factory argument that sets each model's number of repeated layers (``--n-layer``).
LAYER_COUNT_ARG = {"gpt2-tiny": "n_layer", "gpt2-small": "n_layer", "mlp-chain": "n_blocks"}
# The models whose batch shape ``--batch-size``/``--seq-len`` set (a GPU-sized model's shape on a CPU, say).
SHAPE_ARGS = ("gpt2-tiny", "gpt2-small")

GRAD_SEED = 1234  # re-seeded before every compared step, so dropout masks match across strategies
BATCH_SEED = 0
MIN_TIMING_S = 0.05  # shortest timing of one side of a pair; shorter steps are repeated


def run_bench(
    models: list[str],
    budgets: list[float],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    pairs: int = 5,
    *,
    n_layer: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    seed: int = 0,
) -> list[BenchRow]:
    """Benchmark every model in ``models`` at every budget fraction; return one row per (model, strategy)."""
    if pairs < 1:
        raise ValueError(f"bench.run: pairs must be at least 1, got {pairs}; time at least one pair.")
    bad = [f for f in budgets if not f > 0]
    if bad:
        raise ValueError(f"bench.run: budget fractions must be positive, got {bad}; give fractions such as 0.5.")
    fixed = [name for name in models if name not in LAYER_COUNT_ARG]
    if n_layer is not None and fixed:
        raise ValueError(f"bench.run: {fixed} have a fixed depth; drop n_layer or pick from {sorted(LAYER_COUNT_ARG)}.")
    shape = {k: v for k, v in (("batch_size", batch_size), ("seq_len", seq_len)) if v is not None}
    fixed_shape = [name for name in models if name not in SHAPE_ARGS]
    if shape and fixed_shape:
        raise ValueError(f"bench.run: {fixed_shape} have a fixed batch shape; drop {sorted(shape)} or pick from "
                         f"{list(SHAPE_ARGS)}.")
    rows: list[BenchRow] = []
    for name in models:
        kwargs: dict[str, Any] = {"dtype": dtype, "seed": seed, "device": device, **shape}
        if n_layer is not None:
            kwargs[LAYER_COUNT_ARG[name]] = n_layer
        rows.extend(run_model(build(name, **kwargs), budgets, torch.device(device), dtype, pairs))
    return rows


def run_model(
    bench: BenchModel, budgets: list[float], device: torch.device, dtype: torch.dtype, pairs: int
) -> list[BenchRow]:
    """All strategies on one model: the peers first, then our plan at each budget fraction."""
    batch = bench.make_batch(BATCH_SEED)
    none_step = peer_step_of(bench, "none")
    timed_steps(bench, none_step, batch, device)  # warm-up: first-call allocations are not the model's
    none_peak, none_grads, none_loss = metered_bench_step(bench, none_step, batch, device)
    log.info("%s: none peak %d bytes", bench.name, none_peak)
    context = _RunContext(bench, batch, device, dtype, pairs, none_step, none_peak, none_grads, none_loss)

    rows = [context.row(name, peer_step_of(bench, name)) for name in applicable_peers(bench, RUN_PEERS)]
    for fraction in budgets:
        # Each budget is planned, none skipped for an earlier plan's floor: that floor assumed what the earlier plan
        # knew of the outputs' use (NOTE [loss-only first plan] in remat_plugin.runtime.resolver).
        rows.append(_ours_row(context, fraction))
        gc.collect()  # the plan's module and its compiled step are gone; free them before the next plan
    for row in rows:
        row["meta"] = dict(bench.meta)
    return rows


@dataclass
class PlanAttempt:
    """What planning at one budget gave: a module, or the smallest feasible budget, or an error."""

    rm: RematModule | None
    plan_s: float  # capture + profile + solve, as the user waits for it
    min_feasible_bytes: int | None = None  # set when the budget is infeasible
    error: str | None = None  # set when the model could not be planned at all


def plan_timed(bench: BenchModel, batch: Batch, budget_bytes: int, label: str, *, compile: bool = False) -> PlanAttempt:
    """``rematerialize`` at ``budget_bytes`` (``compile``: with compiled programs), timed until the plan settles;
    an infeasible budget or a model that cannot be captured becomes an attempt that says so, so one point does
    not end the whole run."""
    log.info("%s %s: planning for %d bytes", bench.name, label, budget_bytes)
    t0 = time.perf_counter()
    try:
        rm = rematerialize(bench.module, batch[0], batch[1], budget=budget_bytes, compile=compile)
        settle_plan(bench, rm, batch)
    except InfeasibleBudgetError as exc:
        return PlanAttempt(None, time.perf_counter() - t0, min_feasible_bytes=exc.min_feasible_bytes)
    except RematError as exc:
        log.warning("%s %s: %s", bench.name, label, exc)
        return PlanAttempt(None, time.perf_counter() - t0, error=str(exc))
    return PlanAttempt(rm, time.perf_counter() - t0)


def settle_plan(bench: BenchModel, rm: RematModule, batch: Batch) -> None:
    """Unobserved training steps, as a training loop's first ones, until the plan stops changing: a new plan is
    metered before its first step (NOTE [calibration] in remat_plugin.runtime.calibration), the first step
    shows which outputs the loss drops and the next re-plans with them freed (NOTE [output usage] in
    remat_plugin.runtime.resolver)."""
    device = next((p.device for p in bench.module.parameters()), torch.device("cpu"))
    with unobserved(bench.module, device):
        for i in range(8):
            plan = rm.plan
            torch.manual_seed(GRAD_SEED)
            bench.loss(rm(*batch[0], **batch[1])).backward()
            if i >= 2 and rm.plan is plan:
                break
    bench.module.zero_grad(set_to_none=True)


def settled_copy(bench: BenchModel, budget_bytes: int, batch: Batch) -> tuple[BenchModel, RematModule]:
    """A copy of ``bench`` (its module deep-copied: ``bench`` stays the unmodified reference) planned at
    ``budget_bytes`` and settled on ``batch`` (:func:`settle_plan`)."""
    ours = copy.copy(bench)
    ours.module = copy.deepcopy(bench.module)
    rm = RematModule(ours.module, budget_bytes, verbose=False)
    settle_plan(ours, rm, batch)
    return ours, rm


def _ours_row(context: _RunContext, fraction: float) -> BenchRow:
    bench = context.bench
    budget_bytes = int(fraction * context.none_peak)
    name = f"ours@{fraction:g}"
    attempt = plan_timed(bench, context.batch, budget_bytes, name)
    if attempt.min_feasible_bytes is not None:
        return context.infeasible_row(name, fraction, budget_bytes, attempt.min_feasible_bytes, attempt.plan_s)
    if attempt.rm is None:
        row = context.base_row(name, fraction, budget_bytes)
        row["error"] = attempt.error
        return row
    row = _measure_plan(context, attempt.rm, fraction, budget_bytes)
    row["plan_wall_s"] = attempt.plan_s  # capture + profile + solve, as the user waits for it
    return row


def _measure_plan(context: _RunContext, rm: RematModule, fraction: float, budget_bytes: int) -> BenchRow:
    plan = rm.plan
    assert plan is not None, "rematerialize returned a module without a plan"
    loss_of = context.bench.loss

    def step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return loss_of(rm(*args, **kwargs))

    row = context.row(f"ours@{fraction:g}", lambda: _no_patching(step), fraction=fraction, budget_bytes=budget_bytes)
    row.update(
        predicted_peak_bytes=plan.predicted_peak_bytes,
        predicted_time_ratio=plan.predicted_overhead,
        min_feasible_bytes=plan.min_feasible_bytes,
        plan_s=plan.planning_s,
        within_budget=row["measured_peak_bytes"] <= budget_bytes,
        fallback=plan.fallback,
    )
    return row


class _RunContext:
    """What every strategy of one model is measured against: the batch and the ``none`` reference."""

    def __init__(
        self,
        bench: BenchModel,
        batch: Batch,
        device: torch.device,
        dtype: torch.dtype,
        pairs: int,
        none_step: Callable[[], Any],
        none_peak: int,
        none_grads: list[torch.Tensor | None],
        none_loss: float,
    ) -> None:
        self.bench, self.batch, self.device, self.dtype, self.pairs = bench, batch, device, dtype, pairs
        self.none_step, self.none_peak, self.none_grads, self.none_loss = none_step, none_peak, none_grads, none_loss

    def base_row(self, strategy: str, fraction: float | None = None, budget_bytes: int | None = None) -> BenchRow:
        return {
            "model": self.bench.name,
            "strategy": strategy,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "budget_fraction": fraction,
            "budget_bytes": budget_bytes,
            "none_peak_bytes": self.none_peak,
            "measured_peak_bytes": None,
            "predicted_peak_bytes": None,
            "predicted_time_ratio": None,
            "time_ratio": None,
            "time_ratios": [],
            "plan_s": None,
            "plan_wall_s": None,
            "grads_equal": None,
            "within_budget": None,
            "infeasible": False,
            "min_feasible_bytes": None,
            "error": None,
        }

    def row(
        self,
        strategy: str,
        peer_step: Callable[[], Any],
        fraction: float | None = None,
        budget_bytes: int | None = None,
    ) -> BenchRow:
        """Measure one strategy: metered step (peak, grads), then interleaved timing against ``none``."""
        log.info("%s %s: measuring", self.bench.name, strategy)
        row = self.base_row(strategy, fraction, budget_bytes)
        peak, grads, loss = metered_bench_step(self.bench, peer_step, self.batch, self.device)
        equal, max_abs_diff = _compare_grads(self.none_grads, grads, self.dtype)
        ratios = time_ratios(self.bench, self.none_step, peer_step, self.batch, self.device, self.pairs)
        row.update(
            measured_peak_bytes=peak,
            grads_equal=equal,
            grad_max_abs_diff=max_abs_diff,
            loss=loss,
            loss_equal=loss == self.none_loss,
            time_ratios=ratios,
            time_ratio=statistics.median(ratios),
        )
        return row

    def infeasible_row(
        self, strategy: str, fraction: float, budget_bytes: int, min_feasible_bytes: int, plan_wall_s: float | None
    ) -> BenchRow:
        row = self.base_row(strategy, fraction, budget_bytes)
        row.update(infeasible=True, min_feasible_bytes=min_feasible_bytes, plan_wall_s=plan_wall_s)
        return row


# --- steps -------------------------------------------------------------------------------------
# A "peer step" is a zero-argument callable returning a context manager that yields a
# ``step(args, kwargs) -> loss``; entering it (patching layers, for the checkpointing peers) stays
# outside what is metered and timed.


def peer_step_of(bench: BenchModel, name: str) -> Callable[[], Any]:
    peer = EAGER_PEERS[name]
    return lambda: peer(bench)


@contextmanager
def _no_patching(step: Step) -> Iterator[Step]:
    """Our plan needs no patching (the RematModule wraps the module): just yield its step."""
    yield step


def allocator_peak(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """``fn()``'s result and its peak rise at the allocator: the profiler's allocator events on CPU (kernel scratch
    included, NOTE [temporary memory]), the CUDA counters on GPU."""
    if device.type == "cpu":
        return measure_peak_profiler(fn)
    with PeakMeter(device) as meter:
        result = fn()
    return result, meter.peak_bytes


def metered_bench_step(
    bench: BenchModel, peer_step: Callable[[], Any], batch: Batch, device: torch.device
) -> tuple[int, list[torch.Tensor | None], float]:
    """One seeded forward+backward under the meter: (peak bytes, parameter grads, loss)."""
    bench.module.zero_grad(set_to_none=True)
    with peer_step() as step:
        torch.manual_seed(GRAD_SEED)

        def run() -> torch.Tensor:
            loss = step(*batch)
            loss.backward()
            return loss

        loss, peak = allocator_peak(run, device)
    grads = [None if p.grad is None else p.grad.detach().clone() for p in bench.module.parameters()]
    bench.module.zero_grad(set_to_none=True)
    return peak, grads, float(loss.detach())


def budget_of(bench: BenchModel, budget: str | float, batch: Batch, device: torch.device) -> tuple[int, int]:
    """(budget bytes, the unmodified step's measured peak) for a breakdown's ``--budget``: ``"per-layer"``
    (per-layer checkpointing's measured peak, the low-budget point of issue 15) or a share of the unmodified
    peak."""
    none_peak, _, _ = metered_bench_step(bench, peer_step_of(bench, "none"), batch, device)
    if budget == "per-layer":
        return metered_bench_step(bench, peer_step_of(bench, "per_layer"), batch, device)[0], none_peak
    return int(float(budget) * none_peak), none_peak


def timed_steps(
    bench: BenchModel, peer_step: Callable[[], Any], batch: Batch, device: torch.device, repeats: int = 1
) -> float:
    """Seconds for ``repeats`` seeded forward+backward steps, grads reset before each (not timed apart)."""
    with peer_step() as step:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            bench.module.zero_grad(set_to_none=True)
            torch.manual_seed(GRAD_SEED)
            step(*batch).backward()
        _sync(device)
        return time.perf_counter() - t0


def time_ratios(
    bench: BenchModel,
    none_step: Callable[[], Any],
    peer_step: Callable[[], Any],
    batch: Batch,
    device: torch.device,
    pairs: int,
) -> list[float]:
    """``pairs`` interleaved (none, strategy) timings after one warm-up pair; each pair's strategy time over none's.

    A timing of a step shorter than MIN_TIMING_S repeats it, so that timer and scheduler noise
    stays small against what is measured (mlp-chain steps take milliseconds on CPU).
    """
    none_s = timed_steps(bench, none_step, batch, device)  # warm-up pair: first calls pay one-off costs
    timed_steps(bench, peer_step, batch, device)
    repeats = max(1, math.ceil(MIN_TIMING_S / max(none_s, 1e-6)))
    ratios = []
    for _ in range(pairs):
        none_s = timed_steps(bench, none_step, batch, device, repeats)
        strategy_s = timed_steps(bench, peer_step, batch, device, repeats)
        ratios.append(strategy_s / none_s)
    bench.module.zero_grad(set_to_none=True)
    return ratios


def _compare_grads(
    reference: list[torch.Tensor | None], grads: list[torch.Tensor | None], dtype: torch.dtype
) -> tuple[bool, float | None]:
    """Bitwise equal in float64, ``allclose(rtol=1e-5)`` otherwise; also the largest absolute difference."""
    if len(reference) != len(grads) or any((a is None) != (b is None) for a, b in zip(reference, grads)):
        return False, None
    pairs = [(a, b) for a, b in zip(reference, grads) if a is not None and b is not None]
    if dtype == torch.float64:
        equal = all(torch.equal(a, b) for a, b in pairs)
    else:
        equal = all(torch.allclose(a, b, rtol=1e-5) for a, b in pairs)
    max_abs_diff = max((float((a - b).abs().max()) for a, b in pairs if a.numel()), default=0.0)
    return equal, max_abs_diff


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
