"""Where our step's time goes beyond eager's: the profiler's self time per op, eager against our plan.

    python -m remat_plugin.bench overhead-breakdown [--model mlp-chain] [--budget 1.0 | per-layer] [--threads 1]
        [--steps 5] [--pairs 9] [--json results/overhead_breakdown_cpu.json]

At ``--budget 1.0`` (a share of the unmodified step's measured peak) the plan recomputes nothing,
so whatever our step costs above eager's is runtime overhead, not recomputation (benchmarks.md,
"Where we lose").  Both steps run on the same batch, settled first; their wall times are the
medians of interleaved steps (which goes first alternates), and one profiled run of ``--steps``
steps each gives the self CPU time of every profiler event (aten ops, our custom ops, autograd
nodes), per step.  The events that differ most are listed.  Profiling slows each op down, so the
events' times add up to more than the unprofiled wall time; compare them with each other.
``--budget per-layer`` plans for per-layer checkpointing's measured peak: issue 15's low-budget point, whose
step time is to be at most 1.15x eager's (median of at least 7 interleaved pairs).  There the peer itself runs in
the same rotation (eager, ours, per-layer checkpointing; each first, middle and last in turn), so one run says
what both cost at that peak.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from remat_plugin.bench.models import build
from remat_plugin.bench.run import budget_of, peer_step_of, settled_copy, timed_steps

SEED = 1234


def _self_times(step: Callable[[], None], steps: int) -> dict[str, tuple[float, float]]:
    """Per profiler event key: (self CPU ms, calls), per step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: (e.self_cpu_time_total / 1e3 / steps, e.count / steps) for e in prof.key_averages()}


def run(model: str, budget: str | float, steps: int = 5, pairs: int = 9, **model_kwargs) -> dict:
    bench = build(model, **model_kwargs)
    batch = bench.make_batch(0)
    device = next(bench.module.parameters()).device
    budget_bytes, none_peak = budget_of(bench, budget, batch, device)
    ours, rm = settled_copy(bench, budget_bytes, batch)
    assert rm.plan is not None

    def step_of(module: torch.nn.Module, forward: Callable) -> Callable[[], None]:
        def step() -> None:
            module.zero_grad(set_to_none=True)
            torch.manual_seed(SEED)
            bench.loss(forward(*batch[0], **batch[1])).backward()
        return step

    eager, planned = step_of(bench.module, bench.module), step_of(ours.module, rm)
    timed: list[tuple[str, Callable[[], float]]] = [("eager", lambda: _wall_ms(eager)), ("ours", lambda: _wall_ms(planned))]
    if budget == "per-layer":  # the peer whose peak this is, timed in the same rotation as bench compare times it
        peer_step = peer_step_of(bench, "per_layer")
        timed.append(("per_layer", lambda: timed_steps(bench, peer_step, batch, device) * 1e3))
    for _, ms in timed + timed:  # warm-up
        ms()
    wall: dict[str, list[float]] = {name: [] for name, _ in timed}
    for i in range(pairs):  # each variant first, middle and last in turn, in both directions
        order = timed[i % len(timed):] + timed[:i % len(timed)]
        for name, ms in order if (i // len(timed)) % 2 == 0 else reversed(order):
            wall[name].append(ms())
    eager_ops, our_ops = _self_times(eager, steps), _self_times(planned, steps)
    rows: list[dict] = []
    for key in set(eager_ops) | set(our_ops):
        e_ms, e_n = eager_ops.get(key, (0.0, 0.0))
        o_ms, o_n = our_ops.get(key, (0.0, 0.0))
        rows.append({"event": key, "eager_ms": e_ms, "eager_calls": e_n, "ours_ms": o_ms, "ours_calls": o_n})
    rows.sort(key=lambda r: -abs(r["ours_ms"] - r["eager_ms"]))
    medians = {name: statistics.median(times) for name, times in wall.items()}
    totals = {"eager": sum(e_ms for e_ms, _ in eager_ops.values()), "ours": sum(o_ms for o_ms, _ in our_ops.values())}
    peer = {"peer_ratio": medians["per_layer"] / medians["eager"]} if "per_layer" in medians else {}
    return {
        "model": model, "budget": budget, "budget_bytes": budget_bytes, "none_peak_bytes": none_peak,
        "predicted_overhead": rm.plan.predicted_overhead,
        "wall_ms": medians, "wall_ratio": medians["ours"] / medians["eager"], **peer, "events_ms": totals,
        "events": rows, "torch": torch.__version__, "threads": torch.get_num_threads(), "pairs": pairs,
        "steps_profiled": steps,
    }


def _wall_ms(step: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def report(r: dict, top: int = 16) -> str:
    lines = [
        (f"{r['model']} at {_budget_words(r['budget'])} (predicted {r['predicted_overhead']:.3f}x): wall "
         f"{r['wall_ms']['ours']:.2f} ms against eager's {r['wall_ms']['eager']:.2f} ms ({r['wall_ratio']:.3f}x, "
         f"median of {r['pairs']} interleaved {'rounds' if 'peer_ratio' in r else 'pairs'}, {r['threads']} "
         "thread(s))"),
    ]
    if "peer_ratio" in r:
        lines.append(f"  per-layer checkpointing in the same rotation: {r['wall_ms']['per_layer']:.2f} ms "
                     f"({r['peer_ratio']:.3f}x eager); ours {r['wall_ms']['ours'] / r['wall_ms']['per_layer']:.3f}x "
                     "the peer's step")
    lines += [
        (f"  profiler events' self time per step (profiled): ours {r['events_ms']['ours']:.2f} ms, eager "
         f"{r['events_ms']['eager']:.2f} ms"),
        f"  {'event':52s} {'eager ms':>9s} {'calls':>6s} {'ours ms':>9s} {'calls':>6s} {'diff ms':>8s}",
    ]
    for row in r["events"][:top]:
        lines.append(f"  {row['event'][:52]:52s} {row['eager_ms']:9.2f} {row['eager_calls']:6.0f} "
                     f"{row['ours_ms']:9.2f} {row['ours_calls']:6.0f} {row['ours_ms'] - row['eager_ms']:+8.2f}")
    return "\n".join(lines)


def _budget_words(budget: str | float) -> str:
    return "per-layer checkpointing's peak" if budget == "per-layer" else f"{float(budget):g} of the unmodified peak"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m remat_plugin.bench overhead-breakdown",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp-chain")
    parser.add_argument("--budget", default="1.0",
                        help="a share of the unmodified step's measured peak, or 'per-layer' (per-layer "
                             "checkpointing's measured peak)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (bench compare's default)")
    parser.add_argument("--steps", type=int, default=5, help="steps of each profiled")
    parser.add_argument("--pairs", type=int, default=9,
                        help="rounds of interleaved steps timed: eager and ours (and at --budget per-layer the peer)")
    parser.add_argument("--json")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    result = run(opts.model, opts.budget if opts.budget == "per-layer" else float(opts.budget), opts.steps, opts.pairs)
    print(report(result))
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(result, fh, indent=1)
