"""Planning-time benchmark: cold planning of a model at two depths, and chain-DP speed.

    python -m remat_plugin.bench.planning_time [--model llama-tiny] [--layers 4,16] [--budget 0.5]

Each model is planned in a fresh subprocess, so "cold" means no cached op timings or
menus: capture + profile + every solve.  Each time is split into the plan's stages: export
(``torch.export``), trace (AOTAutograd's joint graph), profile (op times and scratch), block
menus (block ILPs), budget search (chain DP and simulator), other (first run, bookkeeping).  The DP is timed on synthetic chains of 14 and
100 blocks with 10 options each at 500 memory slots.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

_COLD = """
import json, sys, time
t0 = time.perf_counter()
import torch
from remat_plugin.bench.models import build
from remat_plugin.runtime.module import rematerialize
bench = build({model!r}, n_layer={n_layer})
args, kwargs = bench.make_batch(0)
t1 = time.perf_counter()
rm = rematerialize(bench.module, args, kwargs, budget={budget})
t2 = time.perf_counter()
stages = dict(rm.plan.planning_stages)
stages["other"] = (t2 - t1) - sum(stages.values())  # the first run of the programs, summary, bookkeeping
print(json.dumps({{"n_layer": {n_layer}, "plan_s": t2 - t1, "blocks": len(rm.plan.blocks),
                   "unique_blocks": rm.plan.n_unique_blocks, "overhead": rm.plan.predicted_overhead,
                   "stages_s": stages}}))
"""


def cold_plan(model: str, n_layer: int, budget_bytes: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _COLD.format(model=model, n_layer=n_layer, budget=budget_bytes)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def dp_time_ms(n_blocks: int, n_options: int = 10, n_slots: int = 500, repeats: int = 3) -> float:
    from remat_plugin.planning.solvers.chain import ChainBlock, ChainOption, solve_chain

    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(n_blocks):
        x = int(rng.integers(1, 4)) * 2**20
        opts = tuple(
            ChainOption(int(k * 2**20), int((k + 2) * 2**20), int((k + 3) * 2**20), 1.0, 2.0 + 0.2 * (n_options - i))
            for i, k in enumerate(np.linspace(0, 8, n_options))
        )
        blocks.append(ChainBlock(x, x, x, 2**19, 1.0, 2 * x, opts))
    keep_all = sum(b.output_bytes + b.options[-1].kept_bytes for b in blocks)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        solve_chain(blocks, keep_all // 3, n_slots)
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny", help="a bench model with an n_layer argument")
    parser.add_argument("--layers", default="4,16", help="the two depths to plan, comma-separated")
    parser.add_argument("--budget", type=float, default=0.5, help="share of each depth's keep-all peak")
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args()
    from remat_plugin.bench.models import build
    from remat_plugin.runtime.module import rematerialize

    depths = [int(n) for n in opts.layers.split(",")]
    results: dict = {"model": opts.model, "cold": [], "dp_ms": {}}
    for n_layer in depths:
        bench = build(opts.model, n_layer=n_layer)
        args, kwargs = bench.make_batch(0)
        plan = rematerialize(bench.module, args, kwargs, budget=10**12).plan
        assert plan is not None
        base = plan.baseline_peak_bytes
        results["cold"].append(cold_plan(opts.model, n_layer, int(base * opts.budget)))
    for n in (14, 100):
        results["dp_ms"][n] = dp_time_ms(n)
    for c in results["cold"]:
        print(f"cold planning {opts.model} {c['n_layer']} layers: {c['plan_s']:.1f} s ({c['blocks']} blocks,"
              f" {c['unique_blocks']} unique)")
        print("  " + ", ".join(f"{name} {s:.2f} s" for name, s in c["stages_s"].items()))
    first, last = results["cold"][0], results["cold"][-1]
    print(f"ratio {last['n_layer']} / {first['n_layer']} layers: {last['plan_s'] / first['plan_s']:.2f}x")
    for n, ms in results["dp_ms"].items():
        print(f"chain DP, {n} blocks x 10 options, 500 slots: {ms:.1f} ms")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
