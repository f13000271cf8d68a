"""Tensors the forward stores on its modules (NOTE [tensors the forward keeps] in
``remat_plugin/capture/assigned_tensors.py``): a planned step does not run the forward's Python, and torch.export
left its fake tensors there.  Each test fails on the code before."""
from __future__ import annotations

import torch
from budgets import planned_beside_eager
from model_factories import ResidualLayers

from remat_plugin.torch_private import FakeTensor


class _Layers(ResidualLayers):
    def __init__(self):
        super().__init__(16, 64)


class KeepsAuxiliaryLoss(_Layers):
    """Stores a statistic in a dict it holds and an auxiliary loss the training loop adds, as some MoE code does."""

    def __init__(self):
        super().__init__()
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x):
        x = self.residual(x)
        self.stats["norm"] = x.detach().norm()
        self.aux_loss = x.abs().mean()
        return x.square().mean()


def test_a_forward_storing_a_statistic_and_an_auxiliary_loss_falls_back_and_trains_as_eager(caplog):
    torch.manual_seed(0)
    model = KeepsAuxiliaryLoss().double()
    x = torch.randn(32, 16, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,), caplog)
    assert planned.plan.fallback
    assert "stores tensors on its modules (aux_loss, stats['norm'])" in caplog.text, caplog.text
    assert not hasattr(model, "aux_loss") and model.stats == {}, "nothing of the trace left on the model"
    for step in range(2):
        for m, module in ((planned, model), (reference, reference)):
            module.zero_grad(set_to_none=True)
            loss = m(x * (step + 1))
            (loss + 0.1 * module.aux_loss).backward()
        assert torch.equal(model.stats["norm"], reference.stats["norm"])
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


class CachesATable(_Layers):
    """Fills a table once, at its first call (as transformers' long-context rotary embeddings do)."""

    def forward(self, x):
        if not hasattr(self, "table"):
            self.table = torch.linspace(0.5, 1.5, 16, dtype=x.dtype)
        return self.residual(x * self.table).square().mean()


def test_a_cache_the_forward_fills_once_is_not_left_as_a_trace_s_fake_tensor():
    torch.manual_seed(0)
    model = CachesATable().double()
    x = torch.randn(32, 16, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,))
    assert not planned.plan.fallback
    assert not isinstance(getattr(model, "table", None), FakeTensor)
    for m in (planned, reference):
        m(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))  # an eager call fills the table again, a real one
    assert isinstance(model.table, torch.Tensor) and not isinstance(model.table, FakeTensor)


class KeepsItsLastOutput(_Layers):
    """Stores what it computed at each call in an attribute its ``__init__`` never set (an attention map kept for
    plotting): new to the module after the trace and holding no gradient, as a cache does, but computed from the
    call."""

    def forward(self, x):
        x = self.residual(x)
        self.last = x.detach()
        return x.square().mean()


def test_a_new_attribute_computed_from_the_call_is_set_at_every_step_not_taken_for_a_cache(caplog):
    torch.manual_seed(0)
    model = KeepsItsLastOutput().double()
    x = torch.randn(32, 16, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,), caplog)
    assert planned.plan.fallback, "a planned step would never set model.last"
    assert "stores tensors on its modules (last)" in caplog.text, caplog.text
    for step in range(2):
        for m in (planned, reference):
            m(x * (step + 1)).backward()
        assert torch.equal(model.last, reference.last)
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
