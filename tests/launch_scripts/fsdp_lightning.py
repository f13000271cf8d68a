"""Lightning ``ModelParallelStrategy`` (FSDP2) on 2 CPU processes, with or without ``AutoRemat``.

    python tests/launch_scripts/fsdp_lightning.py OUT [--budget BYTES] [--model gpt2-tiny]

Every layer and then the model are ``fully_shard``-ed in ``configure_model``.  Manual optimization,
so each step's forward+backward can be metered at the allocator (steps from the fourth on: the
first three plan, meter and check), as the plan counts it: gloo's racing reduce-scatter clones left out,
one layer's unsharded gradients added.  Each rank writes ``OUT.rank{r}.json``: losses, peaks, and
the final parameters gathered whole (float64, SGD: they differ if any gradient does).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from remat_plugin.bench.models import build
from remat_plugin.capture.memory_meter import memory_profile
from remat_plugin.runtime.fsdp_units import in_flight_bytes, step_peak

STEPS, METERED_FROM = 6, 3


class ShardedLM(pl.LightningModule):
    def __init__(self, model: str):
        super().__init__()
        self.automatic_optimization = False
        self.bench = build(model, n_layer=2, batch_size=2, seq_len=64, dtype=torch.float64)
        self.model = self.bench.module
        self.losses: list[float] = []
        # Each metered step's peak as the plan counts it (NOTE [FSDP2 budget]): gloo's reduce-scatter clones, which
        # a step holds or not as gloo's thread races, left out, and one layer's unsharded gradients added instead.
        self.peaks: list[int] = []

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.bench.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.in_flight = in_flight_bytes(self.bench.layers)

    def training_step(self, batch, _):
        batch_idx = len(self.losses)  # the step's index (each epoch has 3 batches per rank)
        args, kwargs = self.bench.make_batch(100 * self.global_rank + batch_idx)
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + batch_idx)

        def fwd_bwd():
            loss = self.bench.loss(self.model(*args, **kwargs))
            self.manual_backward(loss)
            return loss.detach()

        if batch_idx >= METERED_FROM:
            with memory_profile() as prof:
                loss = fwd_bwd()
            self.peaks.append(step_peak(prof) + self.in_flight)
        else:
            loss = fwd_bwd()
        opt.step()
        self.losses.append(loss.item())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(list(range(STEPS)), batch_size=1)


class Recorder(pl.Callback):
    """What AutoRemat planned and metered, read before its teardown removes it."""

    def __init__(self, auto_remat):
        self.auto_remat, self.found = auto_remat, {}

    def on_train_end(self, trainer, pl_module):
        remat = self.auto_remat.fsdp
        self.found = {"planned": remat is not None and bool(remat.groups),
                      "measured_peaks": list(remat.measured_peaks) if remat is not None else []}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--budget", type=int, default=None)
    parser.add_argument("--model", default="gpt2-tiny")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    callbacks = []
    if opts.budget is not None:
        from remat_plugin.integrations.lightning import AutoRemat

        auto_remat = AutoRemat(budget=opts.budget)
        callbacks += [auto_remat, Recorder(auto_remat)]
    torch.manual_seed(0)
    module = ShardedLM(opts.model)
    trainer = pl.Trainer(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         accelerator="cpu", devices=2, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module)
    params = {n: p.full_tensor().tolist() for n, p in module.model.named_parameters()}
    result = {"losses": module.losses, "peaks": module.peaks, "params": params,
              **(callbacks[1].found if callbacks else {"planned": False})}
    with open(f"{opts.out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
