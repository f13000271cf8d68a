"""``python -m remat_plugin.bench compare``: every peer and our plan on one memory–time frontier.

For each model, in one process:

1. ``none``, the unmodified model, is measured first: its peak is the reference that shares and
   budget fractions are taken of, its parameter gradients the reference of the equality check.
2. The peers: per-layer ``torch.utils.checkpoint``, Chen's sqrt(n) segments, Chen's "drop the
   results of cheap ops" (``bench/peers.py``), and ``torch.compile`` with
   ``activation_memory_budget`` at each ratio, compiled once per ratio, dynamo reset in between.
3. Ours, at each budget fraction asked for and at one budget equal to each peer's measured peak
   (``matched_to``): a frontier comparison is at equal measured peak, and our plan is the only
   strategy that takes a budget, so we go to the peers' peaks rather than guess theirs.
4. Memory timelines of one step: ``none`` and ours at one budget measured op by op, and the
   simulator's (``remat_plugin.ir.simulate``) prediction for ours and for the keep-all schedule of the
   same captured program (what ours would run with no recomputation; it frees each value after its
   last use, so it lies a little below eager ``none``).

Every point is measured the same way: one seeded metered step (peak, gradients), then the time
ratio against ``none`` from interleaved step pairs (``bench/run.py``: a warm-up pair, then
``pairs`` pairs, the median of the per-pair ratios). Every point is a dict with the keys of
:data:`POINT_FIELDS`; ``bench/report.py`` and ``bench/plots.py`` format them.

NOTE [which meter]
On CPU every point's ``measured_peak_bytes`` comes from the allocator events of the profiler
(``capture.memory_meter.measure_peak_profiler``): it is the only CPU meter that sees inside torch.compile'd
graphs. The dispatch-mode ``PeakMeter`` does not: while a ``TorchDispatchMode`` is active dynamo
runs the model eagerly, and (seen here, torch 2.13) the compiled module then stays eager for later
calls too, so on gpt2-tiny at ratio 0.3 it reads the eager peak (365.6 MiB) where the profiler
reads 150.0 MiB. So compiled points are never run under it (``dispatch_peak_bytes`` is None);
for eager points it is run as well, as a cross-check (the two agree to the byte on the
transformers; the profiler also sees oneDNN convolution scratch buffers). On CUDA every point uses
the allocator counters (``PeakMeter``), which see compiled code.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from remat_plugin.bench.models import BenchModel, build
from remat_plugin.bench.peers import EAGER_PEERS, applicable_peers, compiled_memory_budget
from remat_plugin.bench.run import BATCH_SEED, GRAD_SEED, allocator_peak, plan_timed, time_ratios
from remat_plugin.capture.memory_meter import PeakMeter, StorageTracker
from remat_plugin.ir.problem import Schedule
from remat_plugin.ir.simulate import simulate
from remat_plugin.runtime.module import RematModule

__all__ = ["COMPARE_SCHEMA_VERSION", "POINT_FIELDS", "CompareSettings", "compare_model", "run_compare"]

log = logging.getLogger(__name__)

COMPARE_SCHEMA_VERSION = 1
Point = dict[str, Any]
Batch = tuple[tuple[Any, ...], dict[str, Any]]
PeerStep = Callable[[], Any]  # () -> context manager yielding step(args, kwargs) -> loss (bench/run.py)

POINT_FIELDS = (
    "model", "strategy", "label", "setting", "matched_to", "device", "dtype", "meter",
    "none_peak_bytes", "budget_bytes", "measured_peak_bytes", "dispatch_peak_bytes", "predicted_peak_bytes",
    "time_ratio", "time_ratios", "predicted_time_ratio", "grads_equal", "grads_exact", "grad_max_abs_diff",
    "loss_equal", "plan_s", "within_budget", "infeasible", "min_feasible_bytes", "error",
)  # fmt: skip
MERGE_MATCHED = 0.01  # peers whose peaks lie within 1% of each other share one matched budget of ours
SKIP_FRACTION = 0.03  # a fraction budget within 3% of a matched one adds nothing to the frontier
TIMELINE_POINTS = 600  # measured timelines are downsampled (bucket maxima) to keep the JSON small


@dataclass(frozen=True)
class CompareSettings:
    """What ``compare`` runs; every field is written into the JSON next to the results."""

    models: tuple[str, ...]
    device: str = "cpu"
    dtype: str = "float32"
    pairs: int = 5  # timed (none, strategy) pairs per point, after one warm-up pair
    fractions: tuple[float, ...] = (1.0, 0.5, 0.3)  # our budgets as shares of none's measured peak
    amb_ratios: tuple[float, ...] = (1.0, 0.7, 0.5, 0.3)  # torch.compile activation_memory_budget values
    backend: str | None = None  # torch.compile backend; None: inductor on CUDA, aot_eager on CPU
    match_peers: bool = True  # also plan ours at each peer's measured peak
    ours_inductor: bool = False  # also ours with compile=True ("ours+inductor") at our fractions and compile's peaks
    timeline_fraction: float = 0.4  # the timeline shows ours at the feasible budget nearest this share
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "float64": torch.float64}[self.dtype]


def run_compare(settings: CompareSettings) -> dict[str, Any]:
    """Run every model of ``settings``; return ``{"points": [...], "timelines": {model: ...}}``."""
    if settings.pairs < 1:
        raise ValueError(f"bench.compare: pairs must be at least 1, got {settings.pairs}; time at least one pair.")
    points: list[Point] = []
    timelines: dict[str, Any] = {}
    for name in settings.models:
        bench = build(name, dtype=settings.torch_dtype, seed=settings.seed, device=settings.device)
        model_points, timelines[bench.name] = compare_model(bench, settings)
        points.extend(model_points)
        del bench  # one model's graphs and plans at a time
        gc.collect()
    return {"points": points, "timelines": timelines}


def compare_model(bench: BenchModel, settings: CompareSettings) -> tuple[list[Point], dict[str, Any]]:
    """All strategies on one model (module docstring); returns its points and its timelines."""
    ctx = _Context(bench, settings)
    points = [ctx.measure(name, name, _eager_step(bench, name)) for name in applicable_peers(bench, EAGER_PEERS)]
    for ratio in settings.amb_ratios:
        points.append(_compiled_point(ctx, ratio))
    timeline: dict[str, Any] = {"series": {"none measured": ctx.record_timeline(_eager_step(bench, "none"))}}
    floor = -1  # smallest feasible budget, once a plan has told us
    for budget_bytes, label, matched_to in _ours_budgets(ctx, points):
        point, rm = _ours_point(ctx, budget_bytes, label, matched_to, floor)
        points.append(point)
        floor = max(floor, point["min_feasible_bytes"] or -1)
        if rm is not None and _nearer(point, timeline, settings.timeline_fraction):
            ours = _ours_timelines(ctx, rm, point)
            timeline["series"].update(ours.pop("series"))
            timeline.update(ours)
        del rm
        gc.collect()  # a plan's compiled step holds graphs; free them before the next plan
    if settings.ours_inductor:  # at our fraction budgets and at torch.compile's peaks: the peer it is for
        for point in [p for p in points if p["strategy"] == "ours" and p["measured_peak_bytes"] is not None
                      and all(m.startswith("compile@") for m in p["matched_to"] or ())]:
            label = point["label"].replace("ours@", "ours+inductor@", 1)
            compiled, rm = _ours_point(ctx, point["budget_bytes"], label, point["matched_to"] or [], -1,
                                       compile=True)
            points.append(compiled)
            del rm
            gc.collect()
    return points, timeline


class _Context:
    """One model's batch and ``none`` reference, and the measurement every point goes through."""

    def __init__(self, bench: BenchModel, settings: CompareSettings) -> None:
        self.bench, self.settings = bench, settings
        self.device = torch.device(settings.device)
        self.batch: Batch = bench.make_batch(BATCH_SEED)
        self.none_step = _eager_step(bench, "none")
        self.metered(self.none_step)  # warm-up: first-call allocations are not the model's
        self.none_peak, self.none_grads, self.none_loss = self.metered(self.none_step)
        log.info("%s: none peak %d bytes", bench.name, self.none_peak)

    def base(self, strategy: str, label: str) -> Point:
        point: Point = dict.fromkeys(POINT_FIELDS)
        point.update(
            model=self.bench.name, strategy=strategy, label=label, device=str(self.device),
            dtype=self.settings.dtype, meter="profiler" if self.device.type == "cpu" else "cuda",
            none_peak_bytes=self.none_peak, time_ratios=[], infeasible=False,
        )  # fmt: skip
        return point

    def metered(self, peer_step: PeerStep) -> tuple[int, list[torch.Tensor | None], float]:
        """One seeded step under the meter of NOTE [which meter]: (peak bytes, parameter grads, loss)."""
        module, batch = self.bench.module, self.batch
        module.zero_grad(set_to_none=True)
        with peer_step() as step:
            torch.manual_seed(GRAD_SEED)

            def run() -> float:
                loss = step(*batch)
                loss.backward()
                return float(loss.detach())

            loss, peak = allocator_peak(run, self.device)
        grads = [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)
        return peak, grads, loss

    def dispatch_peak(self, peer_step: PeerStep) -> int:
        """The dispatch-mode meter's peak of one seeded step (eager strategies only; NOTE [which meter])."""
        self.bench.module.zero_grad(set_to_none=True)
        with peer_step() as step, PeakMeter(self.device) as meter:
            torch.manual_seed(GRAD_SEED)
            step(*self.batch).backward()
        self.bench.module.zero_grad(set_to_none=True)
        return meter.peak_bytes

    def measure(self, strategy: str, label: str, peer_step: PeerStep, *, compiled: bool = False) -> Point:
        """Peak, gradients against none, and the interleaved time ratio of one strategy."""
        log.info("%s %s: measuring", self.bench.name, label)
        point = self.base(strategy, label)
        peak, grads, loss = self.metered(peer_step)
        if not compiled and self.device.type == "cpu":
            point["dispatch_peak_bytes"] = self.dispatch_peak(peer_step)
        exact, equal, max_abs_diff = _grad_check(self.none_grads, grads, self.settings.torch_dtype)
        ratios = time_ratios(self.bench, self.none_step, peer_step, self.batch, self.device, self.settings.pairs)
        point.update(
            measured_peak_bytes=peak, grads_exact=exact, grads_equal=equal, grad_max_abs_diff=max_abs_diff,
            loss_equal=loss == self.none_loss, time_ratios=ratios, time_ratio=statistics.median(ratios),
        )  # fmt: skip
        return point

    def record_timeline(self, peer_step: PeerStep) -> dict[str, Any]:
        """Live bytes after every op of one step, against the share of the step's time elapsed."""
        self.bench.module.zero_grad(set_to_none=True)
        recorder = _TimelineRecorder(self.device)
        with peer_step() as step:
            torch.manual_seed(GRAD_SEED)
            with recorder:
                loss = step(*self.batch)
                fwd_end = len(recorder.samples)
                loss.backward()
        recorder.detach_all()
        self.bench.module.zero_grad(set_to_none=True)
        t0, times = recorder.t0, recorder.times
        span = (times[-1] - t0) or 1.0
        x = [(t - t0) / span for t in times]
        fwd_x = x[fwd_end - 1] if fwd_end else 0.0
        return _series(*_downsample(x, recorder.samples), fwd_x)


class _TimelineRecorder(StorageTracker):
    """The CPU meter's storage tracking (``capture/memory_meter.py``), sampled after every op with a timestamp."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.samples: list[int] = []
        self.times: list[float] = []
        self.t0 = time.perf_counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.samples.append(self.live_bytes)
        self.times.append(time.perf_counter())
        return out


# --- points --------------------------------------------------------------------------------------


def _eager_step(bench: BenchModel, name: str) -> PeerStep:
    peer = EAGER_PEERS[name]
    return lambda: peer(bench)


@contextmanager
def _ready(step: Callable[..., torch.Tensor]) -> Iterator[Callable[..., torch.Tensor]]:
    """A step that needs no patching per call (ours, or a compiled module already set up)."""
    yield step


def _compiled_point(ctx: _Context, ratio: float) -> Point:
    """torch.compile at one activation_memory_budget: compile (timed), then measure like any peer."""
    label = f"compile@{ratio:g}"
    settings, bench = ctx.settings, ctx.bench
    try:
        with compiled_memory_budget(bench, ratio, settings.backend) as step:
            bench.module.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            torch.manual_seed(GRAD_SEED)
            step(*ctx.batch).backward()  # compiles: dynamo traces, AOTAutograd partitions at this ratio
            compile_s = time.perf_counter() - t0
            point = ctx.measure("compile", label, lambda: _ready(step), compiled=True)
    except Exception as exc:  # noqa: BLE001 - a peer that fails to compile is a result, not a crash
        log.warning("%s %s: %s", bench.name, label, exc)
        point = ctx.base("compile", label)
        point["error"] = f"{type(exc).__name__}: {exc}"
        compile_s = None
    point.update(setting=ratio, plan_s=compile_s)
    return point


def _ours_budgets(ctx: _Context, peer_points: list[Point]) -> list[tuple[int, str, list[str]]]:
    """(budget bytes, label, peers matched) for our plan, largest budget first (module docstring, step 3)."""
    matched: list[tuple[int, list[str]]] = []
    if ctx.settings.match_peers:
        peaks = sorted(
            ((p["measured_peak_bytes"], p["label"]) for p in peer_points
             if p["strategy"] != "none" and p["measured_peak_bytes"] is not None),
            reverse=True,
        )  # fmt: skip
        for peak, label in peaks:
            if matched and matched[-1][0] - peak <= MERGE_MATCHED * matched[-1][0]:
                matched[-1][1].append(label)  # keep the lower peak: the budget must reach both peers
                matched[-1] = (peak, matched[-1][1])
            else:
                matched.append((peak, [label]))
    budgets = [(peak, "ours@" + "+".join(labels), labels) for peak, labels in matched]
    for fraction in ctx.settings.fractions:
        budget_bytes = int(fraction * ctx.none_peak)
        if all(abs(budget_bytes - peak) > SKIP_FRACTION * peak for peak, _ in matched):
            budgets.append((budget_bytes, f"ours@{fraction:g}", []))
    return sorted(budgets, key=lambda b: -b[0])


def _ours_point(
    ctx: _Context, budget_bytes: int, label: str, matched_to: list[str], floor: int, *, compile: bool = False
) -> tuple[Point, RematModule | None]:
    """Plan at ``budget_bytes`` (timed) and measure; infeasible budgets become points that say so.

    ``compile``: the plan's programs run as inductor kernels (strategy "ours+inductor"); the time to
    plan includes compiling them.
    """
    bench = ctx.bench
    strategy = "ours+inductor" if compile else "ours"
    point = ctx.base(strategy, label)
    point.update(setting=budget_bytes / ctx.none_peak, budget_bytes=budget_bytes, matched_to=matched_to or None)
    if 0 <= budget_bytes < floor:
        log.info("%s %s: below the smallest feasible budget %d", bench.name, label, floor)
        point.update(infeasible=True, min_feasible_bytes=floor)
        return point, None
    attempt = plan_timed(bench, ctx.batch, budget_bytes, label, compile=compile)
    if attempt.min_feasible_bytes is not None:
        point.update(infeasible=True, min_feasible_bytes=attempt.min_feasible_bytes, plan_s=attempt.plan_s)
        return point, None
    if attempt.rm is None:
        point["error"] = attempt.error
        return point, None
    rm, plan_s = attempt.rm, attempt.plan_s
    plan = rm.plan
    assert plan is not None, "rematerialize returned a module without a plan"
    loss_of = bench.loss

    def step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return loss_of(rm(*args, **kwargs))

    measured = ctx.measure(strategy, label, lambda: _ready(step), compiled=compile)
    point.update({k: v for k, v in measured.items() if v is not None and k not in ("setting", "budget_bytes")})
    point.update(
        predicted_peak_bytes=plan.predicted_peak_bytes, predicted_time_ratio=plan.predicted_overhead,
        min_feasible_bytes=plan.min_feasible_bytes if plan.min_feasible_bytes >= 0 else None, plan_s=plan_s,
        within_budget=point["measured_peak_bytes"] <= budget_bytes,
    )  # fmt: skip
    return point, rm


# --- timelines -----------------------------------------------------------------------------------


def _nearer(point: Point, timeline: dict[str, Any], target: float) -> bool:
    """Whether ``point`` (measured) is nearer the timeline's target share than the one shown so far."""
    if point["measured_peak_bytes"] is None:
        return False
    shown = timeline.get("ours_setting")
    return shown is None or abs(point["setting"] - target) < abs(shown - target)


def _ours_timelines(ctx: _Context, rm: RematModule, point: Point) -> dict[str, Any]:
    """Ours measured, and ours and the keep-all schedule predicted on the plan's problem (module docstring)."""
    series = {"ours measured": ctx.record_timeline(lambda: _ready(lambda a, k: ctx.bench.loss(rm(*a, **k))))}
    problem = rm.problem
    plan = rm.plan
    if problem is not None and plan is not None:
        for name, schedule in (("keep-all", Schedule.keep_all(problem)), ("ours", Schedule(plan.schedule))):
            sim = simulate(problem, schedule)
            op_ms = [problem.op(op).time_ms for op in sim.sequence]
            total = sum(op_ms) or 1.0
            x, elapsed = [], 0.0
            for ms in op_ms:
                x.append(elapsed / total)  # the op's start, as the measured series samples after it ran
                elapsed += ms
            n_fwd = len(problem.fwd_ops)
            series[f"{name} predicted"] = _series(x, list(sim.timeline_bytes), x[n_fwd - 1] if n_fwd else 0.0)
    return {
        "ours_label": point["label"], "ours_setting": point["setting"], "budget_bytes": point["budget_bytes"],
        "series": series,
    }  # fmt: skip


def _series(x: list[float], y: list[int], fwd_end_x: float) -> dict[str, Any]:
    return {"x": [round(v, 5) for v in x], "bytes": y, "fwd_end_x": round(fwd_end_x, 5)}


def _downsample(x: list[float], y: list[int], n: int = TIMELINE_POINTS) -> tuple[list[float], list[int]]:
    """At most ``n`` samples: the largest of each run of consecutive ones, so no peak is lost."""
    if len(y) <= n:
        return x, y
    step = len(y) / n
    xs, ys = [], []
    for i in range(n):
        lo, hi = int(i * step), max(int((i + 1) * step), int(i * step) + 1)
        j = max(range(lo, min(hi, len(y))), key=y.__getitem__)
        xs.append(x[j])
        ys.append(y[j])
    return xs, ys


def _grad_check(
    reference: list[torch.Tensor | None], grads: list[torch.Tensor | None], dtype: torch.dtype
) -> tuple[bool, bool, float | None]:
    """(bitwise equal, equal, largest absolute difference); "equal" is bitwise in float64, else allclose with
    rtol 1e-5 and atol 1e-6 (torch's default atol, 1e-8, fails a reordered sum whose result is near zero).

    allclose is the float32 criterion because a compiled graph may reorder reductions; the bitwise
    answer is reported next to it so a reordering never hides.
    """
    if len(reference) != len(grads) or any((a is None) != (b is None) for a, b in zip(reference, grads)):
        return False, False, None
    pairs = [(a, b) for a, b in zip(reference, grads) if a is not None and b is not None]
    exact = all(torch.equal(a, b) for a, b in pairs)
    equal = exact if dtype == torch.float64 else all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
    max_abs_diff = max((float((a - b).abs().max()) for a, b in pairs if a.numel()), default=0.0)
    return exact, equal, max_abs_diff
