"""A forward that writes into a parameter (``nn.Embedding(max_norm=...)``) is refused at capture with an error that
names the parameter and the fix; it used to fail in its first step with autograd's bare leaf-variable error."""
from __future__ import annotations

import pytest
import torch
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
