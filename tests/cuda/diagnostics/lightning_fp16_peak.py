"""Lightning ``16-mixed`` on CUDA with AutoRemat: what is live at each calibration step's allocator peak.

`python tests/cuda/diagnostics/lightning_fp16_peak.py` (GPU runs, benchmarks.md): the blocks live at the
peak of every metered step, largest first, with the op that allocated each and its thread.
"""
import importlib.util
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
from lightning_gpt2 import StepRecorder, load_options, train

from remat_plugin.integrations.lightning import AutoRemat
from remat_plugin.runtime import calibration

_spec = importlib.util.spec_from_file_location("diag_lib", os.path.join(os.path.dirname(__file__), "diag_lib.py"))
lib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lib)
logging.basicConfig(level=logging.WARNING)
MB = 2**20
_real_trace = calibration.allocator_trace


def traced(prof, device="cpu", excluding=()):
    peak, op, by, top = lib.live_at_peak_in(prof, "cuda")
    print(f"  metered peak {peak / MB:.2f} MiB, at {op}; live blocks by allocating op:", flush=True)
    for name, nbytes in by[:8]:
        print(f"    {nbytes / MB:8.3f} MiB  {name}", flush=True)
    print("  largest blocks (MiB, op, thread):", top[:4], flush=True)
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
