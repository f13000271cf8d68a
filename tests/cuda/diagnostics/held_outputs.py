"""A caller that holds the logits: where the metered peak sits, CPU vs CUDA."""
import logging
import sys

import torch

sys.argv = [sys.argv[0], sys.argv[1] if len(sys.argv) > 1 else "cuda"]
import importlib.util
import os

spec = importlib.util.spec_from_file_location("diagmod", os.path.join(os.path.dirname(__file__), "diag_lib.py"))
lib = importlib.util.module_from_spec(spec); spec.loader.exec_module(lib)
logging.basicConfig(level=logging.WARNING)
logging.getLogger("remat_plugin.runtime.calibration").setLevel(logging.DEBUG)
from remat_plugin import rematerialize
from remat_plugin.bench.models import build
from remat_plugin.capture.memory_meter import warm_backward_workspaces

DEV = sys.argv[1]; MB = 2**20
warm_backward_workspaces(DEV)
a = build("gpt2-tiny", dtype=torch.float64, seed=0, device=DEV, n_layer=2, batch_size=4, seq_len=128)
(args, kwargs) = a.make_batch(0)
plan = rematerialize(a.module, args, kwargs, budget=10**12).plan
for frac in (1.0, 0.6):
    budget = int(plan.min_feasible_bytes + frac * (plan.baseline_peak_bytes - plan.min_feasible_bytes))
    rm = rematerialize(a.module, args, kwargs, budget=budget)
    def held_step():
        a.module.zero_grad(set_to_none=True)
        out = rm(*args, **kwargs)
        out.loss.backward()
        return out.logits.shape
    for _ in range(3): held_step()
    a.module.zero_grad(set_to_none=True)
    peak, op, by, top = lib.live_at_peak(held_step, DEV)
    print(f"== held logits frac {frac}: budget {budget/MB:.2f} predicted {rm.plan.predicted_peak_bytes/MB:.2f} measured {peak/MB:.2f}; peak at {op}; dropped {rm.plan.dropped_outputs}")
    for n, b in by: print(f"   {b/MB:8.3f} MiB  {n}")
    print("   largest live blocks at peak:", top)
