"""Tensors that require grad but are not the model's parameters (NOTE [graded constants] in
``remat_plugin/capture/graded_constants.py``): a traced graph held them as constants and gave them no gradient, so
such a capture is refused naming them; a model with repeated layers falls back and trains them as eager does.
Each test fails on the code before: the step trained without those gradients."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from budgets import planned_beside_eager
from model_factories import ResidualLayers
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.errors import CaptureError

TEMPERATURE = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)  # learnable, outside the model
SHARED = nn.Linear(32, 32).double()  # a layer shared with another model, outside this one


class SoftPrompted(ResidualLayers):
    """A soft prompt kept as a plain tensor attribute, a fixed offset beside it, and a global learnable temperature."""

    def __init__(self, layers: int = 4, as_parameters: bool = False):
        super().__init__(32, 128, n=layers, activation=nn.GELU, dropout=0.1)
        self.prompt = torch.randn(1, 32, dtype=torch.float64, requires_grad=True)
        self.offset = torch.ones(32, dtype=torch.float64)  # no gradient: a constant, as before
        self.temperature = TEMPERATURE
        self.extra = [nn.Linear(32, 32).double()]  # in a Python list: its parameters are not registered
        if as_parameters:  # the fix the refusal names
            self.prompt = nn.Parameter(self.prompt.detach().clone())
            self.temperature = nn.Parameter(TEMPERATURE.detach().clone())

    def forward(self, x):
        x = x + self.prompt + self.offset
        if not isinstance(self.prompt, nn.Parameter):
            x = x + self.extra[0](x) + SHARED(x)
        return (self.residual(x) * self.temperature).pow(2).mean()


def test_a_tensor_attribute_and_a_global_that_require_grad_fall_back_and_get_eager_s_gradients(caplog):
    torch.manual_seed(0)
    model = SoftPrompted().double()
    x = torch.randn(256, 32, dtype=torch.float64)
    planned, reference = planned_beside_eager(model, (x,), caplog)  # its own copies of the prompt and temperature
    assert planned.plan.fallback
    for said in ("'prompt' (not registered with the model)", "'temperature' (not registered with the model)",
                 "'extra[0].weight' (not registered with the model)", "the global 'SHARED.bias' of", "Make it an nn."):
        assert said in caplog.text, said
    for step in range(3):
        grads = []
        for m, module in ((planned, model), (reference, reference)):
            module.zero_grad(set_to_none=True)
            foreign = [module.prompt, module.temperature, *module.extra[0].parameters(), *SHARED.parameters()]
            for t in foreign:
                t.grad = None
            torch.manual_seed(step)
            m(x).backward()
            grads.append([t.grad for t in foreign] + [p.grad for p in module.parameters()])
        assert all(a is not None and torch.equal(a, b) for a, b in zip(*grads)), step


def test_a_model_with_no_layers_to_fall_back_on_is_refused_naming_the_tensor_and_the_fix():
    class Prompted(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)
            self.prompt = torch.zeros(1, 8, requires_grad=True)

        def forward(self, x):
            return self.linear(x + self.prompt).pow(2).mean()

    with pytest.raises(CaptureError, match=r"reads 'prompt' \(not registered with the model\), which requires grad but "
                                           r"is not a parameter of the model.*nn.Parameter"):
        rematerialize(Prompted(), (torch.randn(4, 8),), budget=10**9, verbose=False)


def test_a_global_is_named_and_the_same_tensors_as_parameters_are_planned(caplog):
    class Tempered(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x).tanh()
            return (x * TEMPERATURE).pow(2).mean()

    x = torch.randn(64, 32, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rematerialize(Tempered().double(), (x[:, :8],), budget=10**9, verbose=False)
    assert "reads the global 'TEMPERATURE' of tests.test_graded_constants" in caplog.text or \
        "reads the global 'TEMPERATURE' of test_graded_constants" in caplog.text, caplog.text
    torch.manual_seed(0)
    model = SoftPrompted(layers=2, as_parameters=True).double()
    reference = copy.deepcopy(model)
    planned = rematerialize(model, (x,), budget=10**9, verbose=False)
    assert not planned.plan.fallback
    for m in (planned, reference):
        torch.manual_seed(1)
        m(x).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
    assert model.prompt.grad is not None and model.temperature.grad is not None


def test_a_tensor_computed_outside_and_handed_over_in_an_attribute_falls_back_and_trains_its_encoder(caplog):
    """``model.context = encoder(...)`` before each call: the planned step held the first context as a constant, so
    the encoder got no gradient."""
    class Conditioned(ResidualLayers):
        def __init__(self):
            super().__init__(32, 64)
            self.context = None

        def forward(self, x):
            return self.residual(x + self.context).pow(2).mean()

    torch.manual_seed(0)
    model, encoder = Conditioned().double(), nn.Linear(32, 32).double()
    reference, reference_encoder = copy.deepcopy(model), copy.deepcopy(encoder)
    x, c = torch.randn(64, 32, dtype=torch.float64), torch.randn(2, 1, 32, dtype=torch.float64)
    model.context = encoder(c[0])
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        planned = rematerialize(model, (x,), budget=10**9, verbose=False)
    assert planned.plan.fallback and "'context' (not registered with the model), which requires grad" in caplog.text
    for step in range(2):
        for m, module, enc in ((planned, model, encoder), (reference, reference, reference_encoder)):
            module.zero_grad(set_to_none=True)
            enc.zero_grad(set_to_none=True)
            module.context = enc(c[step])
            m(x).backward()
        assert encoder.weight.grad is not None and torch.equal(encoder.weight.grad, reference_encoder.weight.grad)
