"""What calibration's metered step reads on CUDA against the allocator's own peak statistic, on one step.

benchmarks.md "The first step's gap": on CUDA a plan's first metered step reads logits-sized blocks above its
prediction (float64 gpt2-tiny: 4-6 MiB, logits 3.91 MiB; GPT-2 small at 8 x 1024: 3.07 GiB, two logits), where
settled steps meter within the slack.  Calibration reads the profiler's allocator events (NOTE [unseen frees] in
capture/memory_meter.py); this wraps each metered step in ``max_memory_allocated`` as well, lists the blocks the
profiler saw allocated and never freed, and (CUDA) records the allocator's history to list what was alive at the
true peak.  Usage: python metered_gap.py [tiny|small]  (no argument: both, each in a child).  DEV=cpu runs it on the CPU;
SHAPE=BxT sets the batch; LOGITS_BYTES=N lists where the profiler saw blocks of N bytes allocated and freed.
"""
import logging
import os
import pickle
import subprocess
import sys
from collections import Counter

DEV = os.environ.get("DEV", "cuda")
OUT = os.environ.get("OUT", "/tmp")

CASES = {
    "tiny": ("gpt2-tiny", "float64", {"n_layer": 2, "batch_size": 4, "seq_len": 128}),
    "small": ("gpt2-small", "float32", {"n_layer": 2, "batch_size": 8, "seq_len": 1024}),
}


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def frames_of(frames: list[dict]) -> str:
    mine = [f for f in frames if any(k in f["filename"] for k in ("remat_plugin", "transformers", "metered_gap"))]
    return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in mine[:4]) or \
        " <- ".join(f"{os.path.basename(f['filename'])}:{f['name']}" for f in frames[:3])


def alive_at_peak(snapshot: dict) -> None:
    """Replay the allocator's recorded history: the peak and the blocks alive there."""
    for trace in snapshot["device_traces"]:
        live: dict[int, dict] = {}
        total = peak = 0
        at_peak: list[dict] = []
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
                if total > peak:
                    peak, at_peak = total, list(live.values())
            elif e["action"] == "free_completed" and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
        if not trace:
            continue
        print(f"  history: peak {mib(peak)} of blocks allocated while recording; alive there:", flush=True)
        for e in sorted(at_peak, key=lambda e: -e["size"])[:14]:
            print(f"    {mib(e['size']):>12}  {frames_of(e.get('frames', []))}", flush=True)


def predicted_timeline(step) -> None:
    """The simulator's side: where the predicted peak is, what is alive there, and the ops given scratch."""
    from remat_plugin.ir.problem import Schedule
    from remat_plugin.ir.simulate import simulate, value_lifetimes

    problem, plan = step.problem, step.plan
    if problem is None:
        print("  (no problem on this step)", flush=True)
        return
    sim = simulate(problem, Schedule(plan.schedule))
    at = max(range(len(sim.timeline_bytes)), key=sim.timeline_bytes.__getitem__)
    print(f"  simulated: peak {mib(sim.peak_bytes)} at op {at} {sim.sequence[at]} (base {mib(problem.base_bytes)}, "
          f"live_out {sorted(problem.live_out)[:8]})", flush=True)
    for i in range(max(0, at - 3), min(len(sim.sequence), at + 3)):
        op = problem.op(sim.sequence[i])
        print(f"    {i:4d} {mib(sim.timeline_bytes[i]):>12} {op.name} temp {mib(op.temp_bytes)} out "
              f"{[mib(problem.value(v).size_bytes) for v in op.outputs]}", flush=True)
    deaths = value_lifetimes(problem, list(sim.sequence))
    alive = [(problem.value(v).size_bytes, v, p, d) for p, made in enumerate(deaths[:at + 1])
             for v, d in made.items() if d >= at]
    for size, v, p, d in sorted(alive, reverse=True)[:12]:
        print(f"    alive {mib(size):>12} {v} made at {p} ({sim.sequence[p]}) dies after {d}", flush=True)
    temps = sorted(((o.temp_bytes, o.name) for o in problem.ops if o.temp_bytes), reverse=True)[:8]
    print("  scratch: " + ", ".join(f"{n} {mib(t)}" for t, n in temps), flush=True)


def run(case: str) -> None:
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("remat_plugin.runtime.calibration").setLevel(logging.DEBUG)
    from remat_plugin import rematerialize
    from remat_plugin.bench.models import build
    from remat_plugin.capture import memory_meter
    from remat_plugin.capture.memory_meter import PeakMeter, warm_backward_workspaces
    from remat_plugin.runtime import calibration, resolver

    name, dtype, cfg = CASES[case]
    if os.environ.get("SHAPE"):  # e.g. SHAPE=2x512: batch x sequence length
        cfg = dict(cfg, batch_size=int(os.environ["SHAPE"].split("x")[0]), seq_len=int(os.environ["SHAPE"].split("x")[1]))
    orig_trace, orig_metered = calibration.allocator_trace, resolver.metered_step
    count = [0]

    def traced(prof, device="cpu", *a, **k):
        import json
        import shutil
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            saved = os.path.join(tmp, "t.json")
            prof.export_chrome_trace(saved)  # a session exports once: the meter reads a copy
            prof.export_chrome_trace = lambda path: shutil.copy(saved, path)
            result = orig_trace(prof, device, *a, **k)
            with open(saved) as f:
                events = json.load(f)["traceEvents"]
        kind = 1 if torch.device(device).type == "cuda" else 0
        mem = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"]) for e in events
                     if e.get("name") == "[memory]" and e["args"].get("Device Type") == kind)
        live: dict[int, int] = {}
        for _, nbytes, addr in mem:
            if nbytes > 0:
                live[addr] = nbytes
            else:
                live.pop(addr, None)
        if os.environ.get("LOGITS_BYTES"):  # where each block of this size was allocated and freed, by op
            want = int(os.environ["LOGITS_BYTES"])
            spans = [e for e in events if e.get("ph") == "X"]
            for e in sorted((e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type") == kind
                             and abs(e["args"]["Bytes"]) == want), key=lambda e: e["ts"]):
                inner = [x for x in spans if x["tid"] == e["tid"] and x["ts"] <= e["ts"] <= x["ts"] + x.get("dur", 0)]
                names = [x["name"] for x in sorted(inner, key=lambda x: x["ts"])][-2:]
                print(f"    {e['ts']:.0f} {e['args']['Bytes']:+d} @{e['args']['Addr']:x} tid {e['tid']} {names}")
        sizes = Counter(live.values())
        print(f"  profiler: {len(mem)} events; never freed in the trace: "
              f"{', '.join(f'{n} x {mib(s)}' for s, n in sizes.most_common(6)) or 'none'}", flush=True)
        return result

    def metered(module, step, call):
        count[0] += 1
        warm_backward_workspaces(call.device)
        record = DEV == "cuda" and count[0] <= 2
        if record:
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        with PeakMeter(DEV) as meter:
            peak = orig_metered(module, step, call)
        plan = step.plan
        print(f"[{case}] metered step {count[0]}: profiler read {mib(peak or 0)}, allocator peak statistic "
              f"{mib(meter.peak_bytes)}, predicted {mib(plan.predicted_peak_bytes)}, dropped outputs "
              f"{sorted(plan.dropped_outputs)}, ungraded {sorted(plan.ungraded_outputs)}", flush=True)
        predicted_timeline(step)
        if record:
            torch.cuda.synchronize()
            snap = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            with open(os.path.join(OUT, f"snapshot_{case}_{count[0]}.pickle"), "wb") as f:
                pickle.dump(snap, f)
            alive_at_peak(snap)
        return peak

    calibration.allocator_trace = traced
    resolver.metered_step = metered
    memory_meter  # noqa: B018  (imported for its module path in the frames)

    a = build(name, dtype=getattr(torch, dtype), seed=0, device=DEV, **cfg)
    batch = a.make_batch(0)
    plan = rematerialize(a.module, *batch, budget=10**13).plan
    base, floor = plan.baseline_peak_bytes, plan.min_feasible_bytes
    print(f"[{case}] baseline {mib(base)} floor {mib(floor)}", flush=True)
    budget = int(floor + 0.5 * (base - floor))
    rm = rematerialize(a.module, *batch, budget=budget, verbose=False)
    for i in range(3):
        for p in a.module.parameters():
            p.grad = None
        torch.manual_seed(1)
        if DEV == "cuda":
            torch.cuda.synchronize()
        with PeakMeter(DEV) as meter:
            a.loss(rm(*batch[0], **batch[1])).backward()
        print(f"[{case}] step {i}: caller's step measured {mib(meter.peak_bytes)} (includes any metering), plan "
              f"predicts {mib(rm.plan.predicted_peak_bytes)}, budget {mib(budget)}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for c in CASES:
            subprocess.run([sys.executable, __file__, c], check=False, timeout=200)
