"""Gradient hooks a forward registers on its own tensors (NOTE [hooks in the forward] in
``remat_plugin/capture/tensor_hooks.py``): the trace cannot hold them, so the model is refused at capture (or falls
back per layer) instead of training without them; hooks registered outside the forward keep working."""
from __future__ import annotations

import copy

import pytest
import torch
from budgets import step_grads
from model_factories import ResidualLayers
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


class _Layers(ResidualLayers):
    """Four residual layers with dropout; ``branch``: a data-dependent ``if`` leaves it without a graph."""

    def __init__(self, branch: bool):
        super().__init__(32, 128, n=4, activation=nn.GELU, dropout=0.1)
        self.branch = branch

    def forward(self, x):
        if self.branch and x.sum() > 1e9:
            x = x * 2
        return self.residual(x).pow(2).mean()


@pytest.mark.parametrize("branch", [False, True], ids=["planned", "fallback"])
def test_parameter_hooks_run_once_per_training_step_and_never_in_a_metered_one(branch):
    """NOTE [parameter hooks unobserved]: a gradient hook on each parameter (logging) and an optimizer stepped
    inside backward (``register_post_accumulate_grad_hook``, PyTorch's optimizer-in-backward recipe) run once per
    parameter per training step, as in eager PyTorch, while the plan's metered steps (calibration at a recomputing
    budget; a fallback's sizing) run unobserved.  Those steps ran the gradient hooks once more."""
    from remat_plugin.capture.memory_meter import measure_peak_profiler

    torch.manual_seed(0)
    model = _Layers(branch).double()
    reference = copy.deepcopy(model)
    x = torch.randn(256, 32, dtype=torch.float64)
    probe = copy.deepcopy(model)
    probe(x).backward()
    peak = measure_peak_profiler(lambda: probe(x).backward())[1]

    def instrument(m: nn.Module) -> list[int]:
        seen = [0]
        optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in m.parameters()}

        def step_in_backward(p):
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=True)

        for p in m.parameters():
            p.register_hook(lambda grad: seen.__setitem__(0, seen[0] + 1))
            p.register_post_accumulate_grad_hook(step_in_backward)
        return seen

    ours, eager = instrument(model), instrument(reference)
    planned = rematerialize(model, (x,), budget=int(0.7 * peak), verbose=False)
    for step in range(3):
        for m in (planned, reference):
            torch.manual_seed(step)
            m(x).backward()
        assert ours[0] == eager[0] == 16 * (step + 1), (step, ours, eager)
    assert bool(planned.plan.fallback) == branch
    assert any(b.mode != "keep" for b in planned.plan.blocks), planned.plan.table()  # the budget recomputes
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_an_auto_batch_size_trial_steps_no_optimizer_in_backward():
    """The verification step of auto batch size runs ``backward()`` with the gradients set aside: an optimizer
    stepped by a post-accumulate hook took a step on the trial's gradients (NOTE [parameter hooks unobserved])."""
    from remat_plugin.batch_size.tune import measure_step
    from remat_plugin.runtime.config import RematConfig
    from remat_plugin.runtime.session import RematSession

    torch.manual_seed(0)
    model = _Layers(False).double()
    before = [p.detach().clone() for p in model.parameters()]
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    x = torch.randn(64, 32, dtype=torch.float64)
    measure_step(RematSession(model, RematConfig(budget=10**9, ilp_time_limit_s=0.2)), (x,), {})
    assert fired == [] and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    model(x).backward()
    assert len(fired) == 16


def test_a_metered_step_counts_what_a_clamping_parameter_hook_allocates_without_running_it():
    """NOTE [parameter hooks unobserved]: the hook does not run in a metered step, but a stand-in allocates the
    new gradient it would return, so the metered peak is not below the real step's (it was by one gradient)."""
    from remat_plugin.bench.run import allocator_peak
    from remat_plugin.runtime.side_effects import unobserved

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh())  # a 4 MiB weight
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(1) or g.clamp(-1e-3, 1e-3))
    x = torch.randn(4, 1024)
    cpu = torch.device("cpu")

    def step():
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    _, real = allocator_peak(step, cpu)
    assert calls == [1]
    with unobserved(model, cpu):
        _, metered = allocator_peak(step, cpu)
    assert calls == [1], "the caller's hook ran in a metered step"
    assert metered >= real, (metered, real)
    step()
    assert calls == [1, 1], "the hook is back after the metered step"
