"""A small ResNet with BatchNorm under remat_plugin: the running statistics move once per step.

    python examples/resnet_batchnorm.py [--budget 0.9] [--steps 3]

Recomputing a BatchNorm in the backward must not update its running mean and variance a
second time (plain ``torch.utils.checkpoint`` does).  This trains the same seeded ResNet with
and without the plan and prints, per step, the loss, the measured peak, and whether the
weights and the running statistics are still bitwise equal (float64).
"""
from __future__ import annotations

import argparse
import logging

import torch
import torch.nn.functional as F
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.errors import human_bytes

N_CLASSES, IMAGE_SIZE = 10, 32


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv+BN, identity (or 1x1 conv+BN) shortcut, ReLU after the sum."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetTiny(nn.Module):
    """Stem conv+BN+ReLU, four basic blocks (16, 32, 64, 64 channels), global average pool, linear."""

    def __init__(self, n_classes: int = N_CLASSES, widths: tuple[int, ...] = (16, 32, 64, 64)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks, in_channels = [], widths[0]
        for i, out_channels in enumerate(widths):
            blocks.append(BasicBlock(in_channels, out_channels, stride=1 if i == 0 else 2))
            in_channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_channels, n_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))  # (B, 3, 32, 32) -> (B, 64, 4, 4)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))  # (B, n_classes)
        return F.cross_entropy(logits, y)


def resnet_tiny() -> ResNetTiny:
    """A float64 :class:`ResNetTiny` with seed-0 weights; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = ResNetTiny()
    return model.to(dtype=torch.float64).train()


def make_batch(seed: int, batch_size: int) -> tuple[tuple, dict]:
    """Seeded float64 images and class labels, as ``(args, kwargs)`` for ``model(x, y)``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=gen, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (batch_size,), generator=gen)
    return (x, y), {}


def train_step(model, batch, optimizer) -> float:
    (x, y), _ = batch
    optimizer.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.9, help="share of the unmodified peak (default 0.9)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    ours = resnet_tiny()
    plain = resnet_tiny()  # same seed: the same weights
    batch = make_batch(0, opts.batch_size)
    (x, y), _ = batch
    _, baseline_peak = measure_peak_profiler(lambda: plain(x, y).backward())
    plain.load_state_dict(ours.state_dict())  # undo that step's BatchNorm update
    plain.zero_grad(set_to_none=True)
    budget = int(baseline_peak * opts.budget)
    print(f"unmodified forward+backward peak: {human_bytes(baseline_peak)}; budget: {human_bytes(budget)}")

    rm = rematerialize(ours, *batch, budget=budget)
    print(rm.plan.table())
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(opts.steps):
        batch = make_batch(step, opts.batch_size)
        loss, peak = measure_peak_profiler(lambda: train_step(rm, batch, opt_ours))
        plain_loss = train_step(plain, batch, opt_plain)
        state, plain_state = ours.state_dict(), plain.state_dict()
        same = all(torch.equal(state[k], plain_state[k]) for k in state)
        print(f"step {step}: loss {loss:.6f} (plain {plain_loss:.6f})  measured peak {human_bytes(peak)}"
              f"  weights and BatchNorm statistics equal to plain PyTorch: {same}")
    bn = ours.stem[1]
    print(f"BatchNorm num_batches_tracked after {opts.steps} steps: {int(bn.num_batches_tracked)}")


if __name__ == "__main__":
    main()
