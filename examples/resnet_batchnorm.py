"""A small ResNet with BatchNorm under remat_plugin: the running statistics move once per step.

    python examples/resnet_batchnorm.py [--budget 0.6] [--steps 3]

Recomputing a BatchNorm in the backward must not update its running mean and variance a
second time (plain ``torch.utils.checkpoint`` does).  This trains the same seeded ResNet with
and without the plan and prints, per step, the loss, the measured peak, and whether the
weights and the running statistics are still bitwise equal (float64).
"""
from __future__ import annotations

import argparse
import logging

import torch

from remat_plugin import rematerialize
from remat_plugin.bench.models import resnet_tiny
from remat_plugin.capture.memory_meter import measure_peak
from remat_plugin.errors import human_bytes


def train_step(model, batch, optimizer) -> float:
    (x, y), _ = batch
    optimizer.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.6, help="share of the unmodified peak (default 0.6)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    ours = resnet_tiny(batch_size=opts.batch_size, dtype=torch.float64)
    plain = resnet_tiny(batch_size=opts.batch_size, dtype=torch.float64)  # same seed: the same weights
    batch = ours.make_batch(0)
    (x, y), _ = batch
    _, baseline_peak = measure_peak(lambda: plain.module(x, y).backward())
    plain.module.load_state_dict(ours.module.state_dict())  # undo that step's BatchNorm update
    plain.module.zero_grad(set_to_none=True)
    budget = int(baseline_peak * opts.budget)
    print(f"unmodified forward+backward peak: {human_bytes(baseline_peak)}; budget: {human_bytes(budget)}")

    rm = rematerialize(ours.module, *batch, budget=budget)
    print(rm.plan.table())
    opt_ours = torch.optim.SGD(ours.module.parameters(), lr=0.1)
    opt_plain = torch.optim.SGD(plain.module.parameters(), lr=0.1)
    for step in range(opts.steps):
        batch = ours.make_batch(step)
        loss, peak = measure_peak(lambda: train_step(rm, batch, opt_ours))
        plain_loss = train_step(plain.module, batch, opt_plain)
        state, plain_state = ours.module.state_dict(), plain.module.state_dict()
        same = all(torch.equal(state[k], plain_state[k]) for k in state)
        print(f"step {step}: loss {loss:.6f} (plain {plain_loss:.6f})  measured peak {human_bytes(peak)}"
              f"  weights and BatchNorm statistics equal to plain PyTorch: {same}")
    bn = ours.module.stem[1] if hasattr(ours.module, "stem") else next(
        m for m in ours.module.modules() if isinstance(m, torch.nn.BatchNorm2d))
    print(f"BatchNorm num_batches_tracked after {opts.steps} steps: {int(bn.num_batches_tracked)}")


if __name__ == "__main__":
    main()
