"""Live blocks at the allocator peak, by allocating op: `python tests/cuda/diagnostics/peak_by_op.py [cuda|cpu]` (GPU runs, benchmarks.md)."""
import importlib.util
import os
import sys

import torch

from remat_plugin import rematerialize
from remat_plugin.bench.models import build

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
_spec = importlib.util.spec_from_file_location("diag_lib", os.path.join(os.path.dirname(__file__), "diag_lib.py"))
lib = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lib)
torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False

def step(module, bench, batch, seed=123):
    args, kwargs = batch
    for p in bench.module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    if DEV == "cuda": torch.cuda.manual_seed(seed)
    loss = bench.loss(module(*args, **kwargs)); loss.backward(); return loss.detach()

def live_at_peak(fn):
    peak, op, by, _ = lib.live_at_peak(fn, DEV)
    return peak, op, by


MB = 2**20
for name, kw in [("gpt2-tiny", {"n_layer": 2, "batch_size": 4, "seq_len": 128}), ("llama-tiny", {})]:
    a = build(name, dtype=torch.float64, seed=0, device=DEV, **kw); ref = build(name, dtype=torch.float64, seed=0, device=DEV, **kw)
    batch = a.make_batch(0)
    step(ref.module, ref, batch)
    plan = rematerialize(a.module, *batch, budget=10**12).plan
    for frac in (1.0, 0.6):
        budget = int(plan.min_feasible_bytes + frac * (plan.baseline_peak_bytes - plan.min_feasible_bytes))
        rm = rematerialize(a.module, *batch, budget=budget)
        for _ in range(3): step(rm, a, batch)
        a.module.zero_grad(set_to_none=True)
        peak, op, by = live_at_peak(lambda: step(rm, a, batch))
        print(f"== {name} frac {frac}: budget {budget/MB:.2f} predicted {rm.plan.predicted_peak_bytes/MB:.2f} measured {peak/MB:.2f} MiB; peak at {op}")
        for n, b in by: print(f"   {b/MB:8.3f} MiB  {n}")
    a.module.zero_grad(set_to_none=True)
    peak, op, by = live_at_peak(lambda: step(ref.module, ref, batch))
    print(f"== {name} unmodified: baseline predicted {plan.baseline_peak_bytes/MB:.2f} measured {peak/MB:.2f}; peak at {op}")
    for n, b in by: print(f"   {b/MB:8.3f} MiB  {n}")

if DEV == "cuda":
    import subprocess
    code = ("import torch\nx=torch.randn(64,64,device='cuda',requires_grad=True)\nfor i in range(2):\n"
            " torch.cuda.synchronize(); m0=torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()\n"
            " (x@x).sum().backward(); torch.cuda.synchronize(); print('backward', i, 'peak rise', (torch.cuda.max_memory_allocated()-m0)/2**20, 'MiB, kept', (torch.cuda.memory_allocated()-m0)/2**20)\n"
            "y=torch.randn(64,64,device='cuda'); m0=torch.cuda.memory_allocated(); torch.addmm(y,y,y); print('fwd addmm kept', (torch.cuda.memory_allocated()-m0)/2**20)\n")
    print(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    # resnet BN kernels, eager vs ours
    from torch.profiler import profile
    a = build("resnet-tiny", dtype=torch.float64, seed=0, device=DEV); ref = build("resnet-tiny", dtype=torch.float64, seed=0, device=DEV)
    batch = a.make_batch(0)
    rm = rematerialize(a.module, *batch, budget=10**12)
    for _ in range(2): step(rm, a, batch)
    for label, m, b in (("ours", rm, a), ("eager", ref.module, ref)):
        with profile() as prof: step(m, b, batch)
        print(label, sorted({e.key for e in prof.key_averages() if "norm" in e.key or "conv" in e.key}))
    for enabled in (True, False):
        with torch.backends.cudnn.flags(enabled=enabled, deterministic=True, benchmark=False):
            l1, l2 = step(rm, a, batch), step(ref.module, ref, batch)
            print("cudnn", enabled, "loss equal", torch.equal(l1, l2), "grads equal", all(torch.equal(p.grad, q.grad) for p, q in zip(a.module.parameters(), ref.module.parameters())))
