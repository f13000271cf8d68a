"""The first metered step's gap on CUDA (benchmarks.md "Open: outputs held at the metered step"): which of the
float64 sweep test's circumstances makes it.  Each variant runs in a fresh process and prints calibration's lines
for the sweep's first two budgets.  Usage: python calibration_gap.py [variant]  (no argument: all, each in a child)."""
import logging
import os
import subprocess
import sys

DEV = os.environ.get("DEV", "cuda")

VARIANTS = ["alone", "reference_built", "reference_stepped", "warmed_first", "deterministic", "empty_cache"]


def run(variant: str) -> None:
    import torch

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("remat_plugin.runtime.calibration").setLevel(logging.DEBUG)
    from remat_plugin import rematerialize
    from remat_plugin.bench.models import build
    from remat_plugin.capture.memory_meter import PeakMeter, warm_backward_workspaces

    if variant == "deterministic":
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    if variant == "warmed_first":
        warm_backward_workspaces(DEV)
    cfg = {"n_layer": 2, "batch_size": 4, "seq_len": 128}
    a = build("gpt2-tiny", dtype=torch.float64, seed=0, device=DEV, **cfg)
    batch = a.make_batch(0)
    if variant in ("reference_built", "reference_stepped"):
        ref = build("gpt2-tiny", dtype=torch.float64, seed=0, device=DEV, **cfg)
        if variant == "reference_stepped":
            ref.loss(ref.module(*batch[0], **batch[1])).backward()

    def step(module):
        for p in a.module.parameters():
            p.grad = None
        torch.manual_seed(1)
        a.loss(module(*batch[0], **batch[1])).backward()

    plan = rematerialize(a.module, *batch, budget=10**12).plan
    base, floor = plan.baseline_peak_bytes, plan.min_feasible_bytes
    for frac in (1.0, 0.5):
        if variant == "empty_cache" and DEV == "cuda":
            torch.cuda.empty_cache()
        budget = int(floor + frac * (base - floor))
        rm = rematerialize(a.module, *batch, budget=budget, verbose=False)
        print(f"[{variant}] budget {budget / 2**20:.2f} MiB: first step (calibrates)", flush=True)
        step(rm)
        step(rm)
        a.module.zero_grad(set_to_none=True)
        if DEV == "cuda":
            torch.cuda.synchronize()
        with PeakMeter(DEV) as meter:
            step(rm)
        print(f"[{variant}]   settled: measured {meter.peak_bytes / 2**20:.2f} predicted "
              f"{rm.plan.predicted_peak_bytes / 2**20:.2f} MiB", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for v in VARIANTS:
            subprocess.run([sys.executable, __file__, v], timeout=120)
