"""``accelerate launch`` (2 CPU processes) of FSDP2-sharded gpt2-tiny, with or without ``REMAT_BUDGET``.

    REMAT_BUDGET=... accelerate launch --cpu --num_processes 2 tests/launch_scripts/fsdp_accelerate.py OUT

Accelerate turns FSDP on only on GPUs, so the script shards with ``fully_shard`` (every layer, then
the model) and, with a budget, hands the sharded model to ``remat_plugin.integrations.accelerate.prepare``,
which plans its units.  Steps from the fourth on are metered at the allocator.  Each rank
writes ``OUT.rank{r}.json``: losses, peaks, final parameters gathered whole (float64, SGD).
"""
from __future__ import annotations

import json
import os
import sys

import torch
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard

from remat_plugin.bench.models import build
from remat_plugin.capture.memory_meter import memory_profile
from remat_plugin.integrations import accelerate as remat_accelerate
from remat_plugin.runtime.fsdp_units import in_flight_bytes, step_peak

STEPS, METERED_FROM = 6, 3


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    bench = build("gpt2-tiny", n_layer=2, batch_size=2, seq_len=64, dtype=torch.float64)
    for layer in bench.layers:
        fully_shard(layer)
    fully_shard(bench.module)
    # Without a budget prepare() is accelerator.prepare(model), which on CPU wraps the sharded model in DDP
    # (Accelerate's FSDP is GPU-only): the run without remat uses the sharded model as it is.
    model = remat_accelerate.prepare(accelerator, bench.module) if os.environ.get("REMAT_BUDGET") else bench.module
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.05))
    losses, peaks = [], []  # peaks as the plan counts them: gloo's racing clones left out, one layer's gradients added
    in_flight = in_flight_bytes(bench.layers)
    for step in range(STEPS):
        args, kwargs = bench.make_batch(100 * accelerator.process_index + step)
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + step)

        def fwd_bwd():
            loss = bench.loss(model(*args, **kwargs))
            accelerator.backward(loss)
            return loss.detach()

        if step >= METERED_FROM:
            with memory_profile() as prof:
                loss = fwd_bwd()
            peaks.append(step_peak(prof) + in_flight)
        else:
            loss = fwd_bwd()
        optimizer.step()
        losses.append(loss.item())
    remat = remat_accelerate.find_fsdp(model)
    result = {"losses": losses, "peaks": peaks, "planned": remat is not None and bool(remat.groups),
              "params": {n: p.full_tensor().tolist() for n, p in bench.module.named_parameters()},
              "distributed_type": str(accelerator.distributed_type)}
    with open(f"{out}.rank{accelerator.process_index}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
