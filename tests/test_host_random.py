"""A forward drawing from Python's or NumPy's generator (NOTE [host random draws]) falls back to per-layer
checkpointing, naming the fix: a captured graph would repeat one draw at every step.  Capture leaves both
generators where it found them."""
import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.errors import CaptureError


class LayerDrop(nn.Module):
    """Skips each layer with probability 0.3 by ``random.random()``, and masks features by ``numpy.random``."""

    def __init__(self, n_layers: int = 4, host: str = "both"):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(n_layers))
        self.host = host

    def forward(self, x):
        if self.host in ("numpy", "both"):
            x = x * torch.from_numpy(np.random.rand(x.shape[-1]) > 0.5).to(x.dtype)
        for layer in self.layers:
            if self.host in ("random", "both") and random.random() < 0.3:
                continue
            x = x + torch.tanh(layer(x))
        return x.square().mean()


X = torch.randn(32, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("host", ["random", "numpy", "both"])
def test_host_draws_fall_back_and_train_as_eager(host):
    model = LayerDrop(host=host).double()
    ref = copy.deepcopy(model)
    random.seed(7)
    np.random.seed(7)
    rm = rematerialize(model, (X,), budget=10**9, verbose=False)
    assert (random.random(), np.random.rand()) == _first_draws(7)  # capture left the caller's generators alone
    assert rm.plan is not None and rm.plan.fallback
    drawn = {"random": "random", "numpy": "numpy.random", "both": "random and numpy.random"}[host]
    assert f"draws from {drawn} while it runs" in rm.plan.fallback and "torch.rand" in rm.plan.fallback
    for step in range(3):  # each step draws anew, as eager does
        for m in (rm, ref):
            random.seed(step)
            np.random.seed(step)
            m(X).backward()
        assert all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)  # a skipped layer: None
                   for p, q in zip(model.parameters(), ref.parameters())), step
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def _first_draws(seed: int) -> tuple[float, float]:
    random.seed(seed)
    np.random.seed(seed)
    return random.random(), np.random.rand()


def test_without_layers_to_fall_back_on_the_error_names_the_draw():
    with pytest.raises(CaptureError, match=r"draws from random while it runs.*no list of repeated layers"):
        rematerialize(LayerDrop(n_layers=1, host="random").double(), (X,), budget=10**9, verbose=False)


def test_a_forward_without_host_draws_plans():
    rm = rematerialize(LayerDrop(host="none").double(), (X,), budget=10**9, verbose=False)
    assert rm.plan is not None and not rm.plan.fallback
