"""Planning-time benchmark: cold planning of a model at two depths, and chain-DP speed.

    python -m remat_plugin.bench.planning_time [--model llama-tiny] [--layers 4,16] [--budget 0.5]
        [--replan 8x128,8x256,16x128] [--known-bucket 8x256,8x200,8x180] [--refine] [--repeats 3]

Each model is planned in a fresh subprocess, so "cold" means no cached op timings or
menus: capture + profile + every solve.  Each depth is planned ``--repeats`` times, the depths
interleaved, and reports its median run.  Each time is split into the plan's stages: export
(``torch.export``), trace (AOTAutograd's joint graph), profile (op times and scratch), block
menus (block ILPs), budget search (chain DP and simulator), other (first run, metering,
bookkeeping).  ``--replan`` times plans of new shapes made after a first one in the same
process (what a training run meets when its batch size or sequence length changes) against
cold plans of the same shapes.  ``--known-bucket`` times the first and second steps at shapes inside a
planned bucket (a shorter last batch, dynamic padding): the first captures the graph at its shapes and replays
the bucket's plan.  Both then run one more training step of each new plan or shape, metered at the allocator
against its budget (after every plan is timed, so the timings are as before).  ``--refine`` times the second step of a loop that keeps only the
loss, which plans again with the outputs it drops freed (the first step's export traced again).  The
DP is timed on synthetic chains of 14 and 100 blocks with 10 options each at 500 memory slots.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

_PLANS = """
import json, sys, time
import torch
from remat_plugin.bench.models import build
from remat_plugin.runtime.module import rematerialize
from remat_plugin.bench.planning_time import metered_step
module, planned = None, []
for shape, budget in {plans!r}:
    bench = build({model!r}, **shape)
    module = bench.module if module is None else module  # later shapes: the same model, its caches warm
    args, kwargs = bench.make_batch(0)
    t1 = time.perf_counter()
    rm = rematerialize(module, args, kwargs, budget=budget)
    t2 = time.perf_counter()
    stages = dict(rm.plan.planning_stages)
    stages["other"] = (t2 - t1) - sum(stages.values())  # the first run of the programs, metering, bookkeeping
    print(json.dumps({{"shape": shape, "plan_s": t2 - t1, "blocks": len(rm.plan.blocks),
                       "unique_blocks": rm.plan.n_unique_blocks, "overhead": rm.plan.predicted_overhead,
                       "predicted_ms": rm.plan.predicted_time_ms, "stages_s": stages}}))
    planned.append((rm, bench, args, kwargs, budget))
for rm, bench, args, kwargs, budget in planned if {meter!r} else ():  # after every plan is timed
    print(json.dumps(metered_step(rm, bench, args, kwargs, budget)))
"""


_REFINE = """
import json, time
import torch
from remat_plugin.bench.models import build
from remat_plugin.runtime.module import rematerialize
bench = build({model!r}, n_layer={n_layer})
args, kwargs = bench.make_batch(0)
rm = rematerialize(bench.module, args, kwargs, budget={budget})
times = []
for _ in range(3):  # a training loop keeping only the loss: the second step plans again (NOTE [output usage])
    t0 = time.perf_counter()
    bench.loss(rm(*args, **kwargs)).backward()
    bench.module.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
print(json.dumps({{"replanning_step_s": times[1], "plain_step_s": times[2], "dropped": rm.plan.dropped_outputs,
                   "stages_s": dict(rm.plan.planning_stages)}}))
"""


_KNOWN_BUCKET = """
import json, time
import torch
from remat_plugin.bench.models import build
from remat_plugin.runtime.module import rematerialize
from remat_plugin.bench.planning_time import metered_step
shapes = {shapes!r}
bench = build({model!r}, **shapes[0])
args, kwargs = bench.make_batch(0)
rm = rematerialize(bench.module, args, kwargs, budget={budget})
for _ in range(3):  # settled: the second step plans again for the outputs the loop drops (NOTE [output usage])
    bench.loss(rm(*args, **kwargs)).backward()
    bench.module.zero_grad(set_to_none=True)
n_solved = rm._resolver.n_solved
for shape in shapes[1:]:
    args, kwargs = build({model!r}, **shape).make_batch(1)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        bench.loss(rm(*args, **kwargs)).backward()
        bench.module.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    print(json.dumps({{"shape": shape, "first_step_s": times[0], "next_step_s": times[1],
                       **metered_step(rm, bench, args, kwargs, {budget})}}))
print(json.dumps({{"new_plans": rm._resolver.n_solved - n_solved}}))
"""


def _check(out: subprocess.CompletedProcess) -> None:
    """A failed planning subprocess raises with the end of its own error output, which says why."""
    if out.returncode != 0:
        raise RuntimeError(f"planning_time: a planning subprocess failed (exit {out.returncode}):\n{out.stderr[-3000:]}")


def known_bucket(model: str, shapes: list[dict], share: float) -> dict:
    """Steps at shapes inside the first shape's bucket, after it is planned and settled, in one fresh process: each
    shape's first step (its graph captured, the bucket's plan checked by the simulator) against its second."""
    budget = int(unmodified_peak(model, shapes[0]) * share)
    out = subprocess.run([sys.executable, "-c", _KNOWN_BUCKET.format(model=model, shapes=shapes, budget=budget)],
                         check=False, capture_output=True, text=True)
    _check(out)
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {"planned": shapes[0], "steps": records[:-1], **records[-1]}


def refine_plan(model: str, n_layer: int, budget_bytes: int) -> dict:
    """The second step of a loop that keeps only the loss, which plans again with the dropped outputs freed, in a
    fresh process: its time against the next step's, and the re-plan's stages."""
    out = subprocess.run([sys.executable, "-c", _REFINE.format(model=model, n_layer=n_layer, budget=budget_bytes)],
                         check=False, capture_output=True, text=True)
    _check(out)
    record = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{")))
    return {"n_layer": n_layer, **record}


def plan_in_order(model: str, plans: list[tuple[dict, int]], meter: bool = False) -> list[dict]:
    """Plan ``(shape, budget bytes)`` pairs one after the other in one fresh process; one record each.  ``meter``:
    then, once every plan is timed, run one training step of each at its shape, metered (:func:`metered_step`)."""
    out = subprocess.run([sys.executable, "-c", _PLANS.format(model=model, plans=plans, meter=meter)],
                         check=False, capture_output=True, text=True)
    _check(out)
    records = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    if meter:
        for record, metered in zip(records[:len(plans)], records[len(plans):]):
            record.update(metered)
    return records[:len(plans)]


def metered_step(rm, bench, args: tuple, kwargs: dict, budget_bytes: int) -> dict:
    """One training step (forward, backward of the loss) of a planned module, its peak read at the allocator."""
    from remat_plugin.bench.run import allocator_peak

    module = rm.original  # the model planned, which a later shape's bench does not build again
    _, peak = allocator_peak(lambda: bench.loss(rm(*args, **kwargs)).backward(), next(module.parameters()).device)
    module.zero_grad(set_to_none=True)
    return {"measured_peak_bytes": peak, "budget_bytes": budget_bytes,
            "predicted_peak_bytes": rm.plan.predicted_peak_bytes}


def cold_plan(model: str, n_layer: int, budget_bytes: int) -> dict:
    record = plan_in_order(model, [({"n_layer": n_layer}, budget_bytes)])[0]
    return {"n_layer": n_layer, **record}


def unmodified_peak(model: str, shape: dict) -> int:
    from remat_plugin.bench.models import build
    from remat_plugin.runtime.module import rematerialize

    bench = build(model, **shape)
    args, kwargs = bench.make_batch(0)
    plan = rematerialize(bench.module, args, kwargs, budget=10**12, verbose=False).plan
    assert plan is not None
    return plan.baseline_peak_bytes


def replans(model: str, first: dict, others: list[dict], share: float) -> list[dict]:
    """Each of ``others`` planned right after ``first`` in one process, and cold in its own."""
    budgets = {json.dumps(s): int(unmodified_peak(model, s) * share) for s in [first, *others]}
    results = []
    for shape in others:
        warm = plan_in_order(model, [(first, budgets[json.dumps(first)]), (shape, budgets[json.dumps(shape)])],
                             meter=True)[1]
        cold = plan_in_order(model, [(shape, budgets[json.dumps(shape)])])[0]
        # Overheads (predicted over unmodified step time, each in its own process's op times): two processes
        # measure the same ops a few percent apart, so predicted milliseconds are not comparable across them.
        results.append({"from": first, "to": shape, "replan": warm, "cold": cold,
                        "overhead_vs_cold": warm["overhead"] / cold["overhead"]})
    return results


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


def _shapes(text: str) -> list[dict]:
    """``"8x128,8x256"`` as ``[{"batch_size": 8, "seq_len": 128}, ...]``."""
    return [dict(zip(("batch_size", "seq_len"), map(int, s.split("x")))) for s in text.split(",")]


def _metered(record: dict) -> str:
    mib = 2**20
    fits = "within" if record["measured_peak_bytes"] <= record["budget_bytes"] else "OVER"
    return (f"a step of it measured {record['measured_peak_bytes'] / mib:.2f} MiB at the allocator, {fits} the budget "
            f"of {record['budget_bytes'] / mib:.2f} MiB (predicted {record['predicted_peak_bytes'] / mib:.2f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-tiny", help="a bench model with an n_layer argument")
    parser.add_argument("--layers", default="4,16", help="the two depths to plan, comma-separated")
    parser.add_argument("--budget", type=float, default=0.5, help="share of each depth's keep-all peak")
    parser.add_argument("--replan", metavar="B0xS0,B1xS1,...",
                        help="also time re-plans: the first batch x sequence shape cold, then each other one in the "
                             "same process (caches warm), against each planned cold (e.g. 8x128,8x256,16x128)")
    parser.add_argument("--refine", action="store_true",
                        help="also time the re-plan a loop keeping only the loss makes at its second step (first "
                             "depth)")
    parser.add_argument("--known-bucket", metavar="B0xS0,B1xS1,...",
                        help="also time steps at shapes inside a planned bucket: the first shape planned and settled, "
                             "then each other one's first step (captured, the plan replayed) and second (e.g. "
                             "8x256,8x200,8x180)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="cold plans per depth, interleaved across depths; each depth reports its median run")
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args()

    depths = [int(n) for n in opts.layers.split(",")]
    results: dict = {"model": opts.model, "cold": [], "cold_runs": [], "dp_ms": {}}
    budgets = {n_layer: int(unmodified_peak(opts.model, {"n_layer": n_layer}) * opts.budget) for n_layer in depths}
    # Interleaved (4, 16, 4, 16, ...), so a slow spell of the machine falls on both depths; medians, since one
    # cold plan on this 2-core machine varies by 10-30% from run to run.
    runs: dict[int, list[dict]] = {n: [] for n in depths}
    for _ in range(max(1, opts.repeats)):
        for n_layer in depths:
            runs[n_layer].append(cold_plan(opts.model, n_layer, budgets[n_layer]))
    for n_layer in depths:
        ordered = sorted(runs[n_layer], key=lambda r: r["plan_s"])
        results["cold"].append(ordered[(len(ordered) - 1) // 2])
        results["cold_runs"].append([r["plan_s"] for r in runs[n_layer]])
    if opts.replan:
        shapes = _shapes(opts.replan)
        results["replan"] = replans(opts.model, shapes[0], shapes[1:], opts.budget)
    if opts.known_bucket:
        results["known_bucket"] = known_bucket(opts.model, _shapes(opts.known_bucket), opts.budget)
    if opts.refine:
        results["refine"] = refine_plan(opts.model, depths[0], budgets[depths[0]])  # the first depth's cold budget
    for n in (14, 100):
        results["dp_ms"][n] = dp_time_ms(n)
    for c in results["cold"]:
        print(f"cold planning {opts.model} {c['n_layer']} layers: {c['plan_s']:.1f} s ({c['blocks']} blocks,"
              f" {c['unique_blocks']} unique)")
        print("  " + ", ".join(f"{name} {s:.2f} s" for name, s in c["stages_s"].items()))
    first, last = results["cold"][0], results["cold"][-1]
    pairs = [b / a for a, b in zip(results["cold_runs"][0], results["cold_runs"][-1])]
    print(f"ratio {last['n_layer']} / {first['n_layer']} layers: {last['plan_s'] / first['plan_s']:.2f}x (medians of "
          f"{len(pairs)} interleaved cold plans each; run by run: {', '.join(f'{r:.2f}x' for r in pairs)})")
    for n, ms in results["dp_ms"].items():
        print(f"chain DP, {n} blocks x 10 options, 500 slots: {ms:.1f} ms")
    for r in results.get("replan", []):
        shape = "{batch_size}x{seq_len}"
        print(f"re-plan {shape.format(**r['from'])} -> {shape.format(**r['to'])}: {r['replan']['plan_s']:.1f} s "
              f"(cold {r['cold']['plan_s']:.1f} s); predicted overhead {r['replan']['overhead']:.3f}x, "
              f"the cold plan's {r['cold']['overhead']:.3f}x ({r['overhead_vs_cold'] - 1:+.1%})")
        print("  " + ", ".join(f"{name} {s:.2f} s" for name, s in r["replan"]["stages_s"].items()))
        print("  " + _metered(r["replan"]))
    if "known_bucket" in results:
        kb, shape = results["known_bucket"], "{batch_size}x{seq_len}"
        for r in kb["steps"]:
            print(f"known bucket ({shape.format(**kb['planned'])} planned) -> {shape.format(**r['shape'])}: first step "
                  f"{r['first_step_s']:.2f} s, next {r['next_step_s']:.2f} s (replay {r['first_step_s'] - r['next_step_s']:.2f} s)")
            print("  " + _metered(r))
        print(f"  new plans made for them: {kb['new_plans']}")
    if "refine" in results:
        r = results["refine"]
        print(f"re-plan for the dropped outputs {r['dropped']} ({r['n_layer']} layers): the step that plans again "
              f"{r['replanning_step_s']:.2f} s, the next step {r['plain_step_s']:.2f} s")
        print("  " + ", ".join(f"{name} {s:.2f} s" for name, s in r["stages_s"].items()))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
