"""A forward that writes into a parameter (``nn.Embedding(max_norm=...)``) is refused at capture with an error that
names the parameter and the fix; it used to fail in its first step with autograd's bare leaf-variable error."""
from __future__ import annotations

import pytest
import torch
from budgets import planned_beside_eager
from model_factories import ResidualLayers
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.errors import CaptureError


class Renormalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16, max_norm=1.0)
        self.proj = nn.Linear(16, 16)

    def forward(self, ids):
        return self.proj(self.embed(ids)).tanh().pow(2).mean()


def test_a_forward_renormalizing_its_embedding_is_refused_with_the_fix():
    ids = torch.randint(0, 50, (4, 8))
    with pytest.raises(CaptureError, match=r"writes into its parameter embed\.weight in place.*max_norm"):
        rematerialize(Renormalized(), (ids,), {}, budget=10**12, verbose=False)


def test_an_embedding_without_max_norm_plans():
    model = Renormalized()
    model.embed.max_norm = None
    ids = torch.randint(0, 50, (4, 8))
    planned = rematerialize(model, (ids,), {}, budget=10**12, verbose=False)
    planned(ids).backward()
    assert model.embed.weight.grad is not None


class Clipped(ResidualLayers):
    """Clips its first layer's weight under torch.no_grad() in its forward (a WGAN critic's constraint): export wraps
    the write in a no-grad region of its own graph."""

    def __init__(self):
        super().__init__(16, 32)

    def forward(self, x):
        with torch.no_grad():
            self.layers[0][0].weight.clamp_(-0.1, 0.1)
        return self.residual(x).square().mean()


def test_a_weight_clipped_under_no_grad_in_the_forward_falls_back_and_trains_as_eager(caplog):
    """Its first step failed with autograd's bare leaf-variable error (the write inside the no-grad region went
    unseen); it is refused naming the parameter, and the model's layers fall back: 3 steps bitwise eager's."""
    torch.manual_seed(0)
    model = Clipped().double()
    x = torch.randn(32, 16, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,), caplog)
    assert planned.plan.fallback and "writes into its parameter layers.0.0.weight in place" in caplog.text
    for step in range(3):
        for m in (planned, reference):
            m(x * (step + 1)).backward()
    assert all(torch.equal(p, q) and torch.equal(p.grad, q.grad)
               for p, q in zip(model.parameters(), reference.parameters()))
