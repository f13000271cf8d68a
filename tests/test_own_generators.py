"""A forward drawing from a generator it passes to an op (``generator=``) is refused, with no fallback: the plan
replays the default generators' draws only, and per-layer checkpointing restores only those too."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.errors import CaptureError


class NoisyLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x):
        return self.linear(x + torch.rand(x.shape, generator=self.generator)).tanh()


class NoisyLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(NoisyLayer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("model", [NoisyLayer, NoisyLayers])
def test_an_own_generator_is_refused_without_falling_back(model):
    with pytest.raises(CaptureError, match=r"torch\.Generator passed to the op .*test_own_generators\.py.*Pass no "
                                           r"generator=") as refused:
        rematerialize(model(), (torch.randn(4, 8),), budget=10**12, verbose=False)
    assert "fall back" not in str(refused.value)
