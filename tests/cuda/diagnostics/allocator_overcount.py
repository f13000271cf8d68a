"""Allocated against requested bytes at a step's peak on CUDA: `python tests/cuda/diagnostics/allocator_overcount.py`.

The caching allocator counts a cached block whole when it serves a smaller request without splitting it
(NOTE [allocator slack]); ``requested_bytes`` is what the callers asked for.  Where a step's measured peak is
above its plan's prediction, this shows how much of the gap is that over-count (GPU runs, benchmarks.md).
"""
import logging

import torch

from remat_plugin import rematerialize
from remat_plugin.bench.models import build

logging.basicConfig(level=logging.WARNING)
MB = 2**20


def step(module, bench, batch, seed=123):
    args, kwargs = batch
    for p in bench.module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    loss = bench.loss(module(*args, **kwargs))
    loss.backward()


def metered(fn):
    torch.cuda.synchronize()
    s0 = torch.cuda.memory_stats()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    s1 = torch.cuda.memory_stats()
    alloc = s1["allocated_bytes.all.peak"] - s0["allocated_bytes.all.current"]
    req = s1["requested_bytes.all.peak"] - s0["requested_bytes.all.current"]
    return alloc, req


for name, kw in [("gpt2-tiny", {"n_layer": 2, "batch_size": 4, "seq_len": 128}), ("llama-tiny", {})]:
    a = build(name, dtype=torch.float64, seed=0, device="cuda", **kw)
    ref = build(name, dtype=torch.float64, seed=0, device="cuda", **kw)
    batch = a.make_batch(0)
    step(ref.module, ref, batch)  # a second model in the process, as in the tests
    plan = rematerialize(a.module, *batch, budget=10**12).plan
    for frac in (1.0, 0.5, 0.2):
        budget = int(plan.min_feasible_bytes + frac * (plan.baseline_peak_bytes - plan.min_feasible_bytes))
        try:
            rm = rematerialize(a.module, *batch, budget=budget)
            for _ in range(3):
                step(rm, a, batch)
            rows = []
            for _ in range(3):
                a.module.zero_grad(set_to_none=True)
                rows.append(metered(lambda rm=rm: step(rm, a, batch)))
        except Exception as exc:  # noqa: BLE001 - a diagnostic reports and goes on
            print(f"{name} frac {frac}: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        print(f"{name} frac {frac}: budget {budget / MB:.2f} predicted {rm.plan.predicted_peak_bytes / MB:.2f} MiB; "
              "(allocated, requested) peak rises, 3 steps: "
              + ", ".join(f"({x / MB:.2f}, {r / MB:.2f})" for x, r in rows))
    ref.module.zero_grad(set_to_none=True)
    x, r = metered(lambda: step(ref.module, ref, batch))
    print(f"{name} unmodified: predicted {plan.baseline_peak_bytes / MB:.2f} allocated {x / MB:.2f} requested {r / MB:.2f}")
