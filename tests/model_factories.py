"""A ``module:factory`` for ``remat plan`` tests: ``factory(batch_size=, seq_len=) -> (module, args, kwargs)``."""
from __future__ import annotations

import torch
from torch import nn


def mlp(batch_size: int, seq_len: int):
    """Four Linear+GELU layers over ``batch_size x seq_len`` rows of width 256, summed to a scalar."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())]
    model = nn.Sequential(*layers)

    class SumLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return self.body(x).pow(2).mean()

    return SumLoss(), (torch.randn(batch_size * seq_len, 256),), {}


def not_a_factory(batch_size: int, seq_len: int):
    return "nothing"
