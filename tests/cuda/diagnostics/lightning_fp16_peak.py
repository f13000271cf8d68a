"""Lightning ``16-mixed`` on CUDA with AutoRemat: what is live at each calibration step's allocator peak.

`python tests/cuda/diagnostics/lightning_fp16_peak.py` (GPU runs, benchmarks.md): the blocks live at the
peak of every metered step, largest first, with the op that allocated each and its thread.
"""
import collections
import json
import logging
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
from lightning_gpt2 import StepRecorder, load_options, train

from remat_plugin.integrations.lightning import AutoRemat
from remat_plugin.runtime import calibration

logging.basicConfig(level=logging.WARNING)
MB = 2**20
_real_trace = calibration.allocator_trace


def _live_at_peak(prof):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    ops = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("tid")) for e in trace
           if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    mem = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"], e.get("tid")) for e in trace
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 1)
    live, cur, peak, snap = {}, 0, 0, {}
    for ts, nbytes, addr, tid in mem:
        if nbytes > 0:
            live[addr] = (nbytes, ts, tid)
        elif addr in live:
            live.pop(addr)
        else:
            continue
        cur += nbytes
        if cur > peak:
            peak, snap = cur, dict(live)

    def owner(ts, tid):
        inner = [(s, n) for s, e, n, t in ops if s <= ts <= e and t == tid]
        return max(inner)[1] if inner else "?"

    by = collections.Counter()
    for nbytes, ts, tid in snap.values():
        by[(owner(ts, tid), tid)] += nbytes
    print(f"  metered peak {peak / MB:.2f} MiB; live blocks by allocating op (thread):", flush=True)
    for (name, tid), nbytes in by.most_common(8):
        print(f"    {nbytes / MB:8.3f} MiB  {name}  (tid {tid})", flush=True)
    big = sorted(((n, owner(ts, tid), tid) for n, ts, tid in snap.values()), reverse=True)[:4]
    print("  largest blocks:", [(round(n / MB, 3), o, t) for n, o, t in big], flush=True)


def traced(prof, device="cpu", excluding=()):
    _live_at_peak(prof)
    return _real_trace(prof, device, excluding)


calibration.allocator_trace = traced
tiny = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.vocab_size=500", "model.n_positions=256",
        "data.batch_size=4", "data.seq_lens=[128]", "data.batches_per_len=4", "trainer.max_steps=4",
        "trainer.accelerator=gpu", f"trainer.precision={sys.argv[1] if len(sys.argv) > 1 else '16-mixed'}"]
plain = StepRecorder()
train(load_options(None, tiny), [plain])
print("plain peaks (MiB):", [round(p / MB, 2) for p in plain.peaks], flush=True)
budget = max(plain.peaks) // 2
for label, b in (("half the largest step peak", budget), ("half the last step peak", plain.peaks[-1] // 2)):
    print(f"== AutoRemat at {label}: {b / MB:.2f} MiB", flush=True)
    ours = StepRecorder()
    try:
        train(load_options(None, tiny), [AutoRemat(budget=b, ilp_time_limit_s=0.2), ours])
        print("ours peaks (MiB):", [round(p / MB, 2) for p in ours.peaks], "losses", ours.losses, "plain", plain.losses)
    except Exception as exc:  # noqa: BLE001 - a diagnostic reports and goes on
        print(f"{type(exc).__name__}: {str(exc)[:400]}")
