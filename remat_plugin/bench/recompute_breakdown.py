"""Where a plan's step time goes at a low budget: per kind of op, its forward time, what the plan recomputes.

    python -m remat_plugin.bench recompute-breakdown [--model gpt2-tiny] [--budget per-layer | F] [--threads 1]
        [--json results/recompute_breakdown_cpu.json]

The budget is per-layer checkpointing's peak measured by the allocator (``per-layer``, the
default) or a fraction of the unmodified step's.  Our plan is made there and settled as a
training loop's first steps settle it; then its op-time model is read out: the forward's and
the backward's times, the recomputation the plan adds, and per kind of op (``addmm``,
``_safe_softmax``, ...) the forward time, the time recomputed, and the bytes the backward reads.
It answers why a plan at that budget costs what it does: the step time it predicts is
``(forward + backward + recomputed) / (forward + backward)``, and a target such as 1.15x allows
recomputing at most ``0.15 x (forward + backward)``.  Nothing is timed here (``bench compare``
times the plans): the numbers are the profiled op times the planner chose with.
"""
from __future__ import annotations

import argparse
import collections
import json
import re

import torch

from remat_plugin.bench.models import build
from remat_plugin.bench.run import budget_of, settled_copy
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.ir.problem import Schedule
from remat_plugin.planning.menus import kept_reads

SEED = 1234


def op_kind(name: str) -> str:
    """``addmm_3`` -> ``addmm``; ``apply_dropout_mask_default_2`` -> ``apply_dropout_mask``."""
    return re.sub(r"(_default)?(_\d+)?$", "", name)


def run(model: str, budget: str) -> dict:
    bench = build(model)
    batch = bench.make_batch(0)
    device = next(bench.module.parameters()).device
    budget_bytes, none_peak = budget_of(bench, budget, batch, device)
    ours, rm = settled_copy(bench, budget_bytes, batch)
    plan, problem = rm.plan, rm.problem
    assert plan is not None and problem is not None and plan.schedule is not None
    schedule = Schedule(plan.schedule)

    def step() -> None:
        torch.manual_seed(SEED)
        ours.loss(rm(*batch[0], **batch[1])).backward()

    _, peak = measure_peak_profiler(step)
    fwd = {o.name: o for o in problem.fwd_ops}
    bwd_reads = {v for o in problem.ops if not o.is_fwd for v in o.inputs}
    kept = kept_reads(problem, schedule)
    kinds: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(
        ("fwd_ms", "recomputed_ms", "bwd_read_bytes", "kept_bytes"), 0.0))
    for o in problem.fwd_ops:
        row = kinds[op_kind(o.name)]
        row["fwd_ms"] += o.time_ms
        for v in o.outputs:
            size = problem.value(v).size_bytes
            row["bwd_read_bytes"] += size if v in bwd_reads else 0
            row["kept_bytes"] += size if v in kept else 0
    for name in schedule.bwd_sequence:
        if name in fwd:
            kinds[op_kind(name)]["recomputed_ms"] += fwd[name].time_ms
    forward_ms = sum(o.time_ms for o in problem.fwd_ops)
    backward_ms = sum(o.time_ms for o in problem.ops if not o.is_fwd)
    recomputed_ms = sum(r["recomputed_ms"] for r in kinds.values())
    return {
        "model": model, "budget": budget, "budget_bytes": budget_bytes, "none_peak_bytes": none_peak,
        "measured_peak_bytes": peak, "predicted_peak_bytes": plan.predicted_peak_bytes,
        "forward_ms": forward_ms, "backward_ms": backward_ms, "recomputed_ms": recomputed_ms,
        "predicted_overhead": plan.predicted_overhead,
        "recompute_everything_overhead": (2 * forward_ms + backward_ms) / (forward_ms + backward_ms),
        "kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["fwd_ms"])),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }


def report(r: dict) -> str:
    step = r["forward_ms"] + r["backward_ms"]
    lines = [
        (f"{r['model']} at {r['budget_bytes'] / 2**20:.2f} MiB ({r['budget_bytes'] / r['none_peak_bytes']:.2f} of the "
        f"unmodified peak; budget {r['budget']}): measured peak {r['measured_peak_bytes'] / 2**20:.2f} MiB"),
        (f"  forward {r['forward_ms']:.1f} ms + backward {r['backward_ms']:.1f} ms (forward {r['forward_ms'] / step:.0%} "
        f"of the step); the plan recomputes {r['recomputed_ms']:.1f} ms ({r['recomputed_ms'] / r['forward_ms']:.0%} of "
        f"the forward): predicted {r['predicted_overhead']:.3f}x; recomputing the whole forward once "
        f"{r['recompute_everything_overhead']:.3f}x; 1.15x would allow {0.15 * step:.1f} ms"),
        f"  {'op kind':24s} {'forward ms':>11s} {'recomputed ms':>14s} {'backward reads':>15s} {'kept':>10s}",
    ]
    for kind, row in r["kinds"].items():
        if row["fwd_ms"] < 0.005 * r["forward_ms"]:
            continue
        lines.append(f"  {kind:24s} {row['fwd_ms']:11.1f} {row['recomputed_ms']:14.1f} "
                     f"{row['bwd_read_bytes'] / 2**20:11.1f} MiB {row['kept_bytes'] / 2**20:6.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m remat_plugin.bench recompute-breakdown",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--budget", default="per-layer",
                        help="'per-layer' (per-layer checkpointing's measured peak) or a fraction of the unmodified peak")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (bench compare's default)")
    parser.add_argument("--json")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    result = run(opts.model, opts.budget)
    print(report(result))
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(result, fh, indent=1)
