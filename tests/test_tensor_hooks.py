"""Gradient hooks a forward registers on its own tensors (NOTE [hooks in the forward] in
``remat_plugin/capture/tensor_hooks.py``): the trace cannot hold them, so the model is refused at capture (or falls
back per layer) instead of training without them; hooks registered outside the forward keep working."""
from __future__ import annotations

import copy

import pytest
import torch
from budgets import step_grads
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.errors import CaptureError


class Reversed(nn.Module):
    """A domain-adaptation head: the gradient into the features is reversed and halved by a hook."""

    def __init__(self):
        super().__init__()
        self.features = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        h = self.features(x).tanh()
        if h.requires_grad:
            h.register_hook(lambda grad: grad * -0.5)
        return self.head(h).pow(2).mean()


class RetainsGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        h.retain_grad()
        self.last = h
        return h.pow(2).mean()


@pytest.mark.parametrize("model,call", [(Reversed, "register_hook"), (RetainsGrad, "retain_grad")])
def test_a_hook_or_retain_grad_in_the_forward_is_refused_naming_the_line_and_the_fix(model, call):
    with pytest.raises(CaptureError, match=rf"{call}\(\) at .*test_tensor_hooks\.py:\d+.*autograd\.Function"):
        rematerialize(model(), (torch.randn(4, 8),), budget=10**12, verbose=False)


class HookedLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Reversed() for _ in range(3))

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


def test_hooks_inside_repeated_layers_fall_back_and_keep_the_hooks():
    torch.manual_seed(0)
    model = HookedLayers().double()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(4, 8, dtype=torch.float64),) for _ in range(2)]
    planned = rematerialize(model, batches[0], budget=10**12, verbose=False)
    assert planned.plan.fallback
    for ours, eager in zip(step_grads(planned, batches, lambda loss: loss),
                           step_grads(reference, batches, lambda loss: loss)):
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))


def test_a_parameter_hook_registered_before_training_runs_on_the_planned_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m[0].weight.register_hook(lambda grad: grad.clamp(-1e-3, 1e-3))
    batches = [(torch.randn(4, 8, dtype=torch.float64),) for _ in range(2)]
    planned = rematerialize(model, batches[0], budget=10**12, verbose=False)
    for ours, eager in zip(step_grads(planned, batches, lambda out: out.pow(2).mean()),
                           step_grads(reference, batches, lambda out: out.pow(2).mean())):
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))
        assert ours[0].abs().max() <= 1e-3
