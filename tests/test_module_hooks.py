"""Module hooks (NOTE [module hooks]): backward hooks run, through the per-layer fallback; forward hooks' side
effects are said to run only while tracing; PyTorch's own hooks (pruning, spectral norm) plan quietly."""
import copy
import logging

import torch
from budgets import assert_same_grads_and_buffers
from torch import nn
from torch.nn.utils import prune

from remat_plugin import rematerialize


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


X = torch.randn(256, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
BUDGET = int(1.5 * 2**20 * 0.6)  # 0.6 of the unmodified step's peak: some layers recomputed


def _halve_input_grads(module, grad_input, grad_output):
    return tuple(None if g is None else g * 0.5 for g in grad_input)


def _steps(rm, ref: nn.Module, n: int = 2, label: str = "") -> None:
    for i in range(n):
        rm(X).square().sum().backward()
        ref(X).square().sum().backward()
        assert_same_grads_and_buffers(rm.original, ref, f"{label} step {i}")
        rm.original.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_backward_hooks_run_as_in_eager_through_the_per_layer_fallback(caplog):
    model = Chain().double()
    calls: list[str] = []
    model.layers[3].register_full_backward_hook(_halve_input_grads)  # changes every gradient below layer 3
    model.layers[4].register_full_backward_pre_hook(lambda m, g: calls.append("pre"))
    ref = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, (X,), budget=BUDGET, verbose=False)
    assert rm.plan is not None and rm.plan.fallback and "backward hooks" in rm.plan.fallback
    assert "_halve_input_grads on layers.3" in caplog.text and "falling back" in caplog.text
    calls.clear()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        _steps(rm, ref, label="backward hooks")  # bitwise, the halving included
    assert calls == ["pre"] * 4  # each step's backward ran it, ours and eager's: no metered step ran it again
    assert "is not metered: a metered step would run its hooks" in caplog.text  # NOTE [metered fallback]
    assert all(b.mode == "checkpoint" for b in rm.plan.blocks)


def test_a_backward_hook_added_after_planning_captures_again_and_runs():
    model = Chain().double()
    ref = copy.deepcopy(model)
    rm = rematerialize(model, (X,), budget=BUDGET, verbose=False)
    _steps(rm, ref, n=1, label="planned")
    assert rm.plan is not None and not rm.plan.fallback
    for m in (model, ref):
        m.layers[2].register_full_backward_hook(_halve_input_grads)
    _steps(rm, ref, label="hook added")
    assert rm.plan.fallback and "backward hooks" in rm.plan.fallback


def test_forward_hooks_are_traced_and_their_side_effects_said_once(caplog):
    model = Chain().double()
    ref = copy.deepcopy(model)
    stored: dict[str, torch.Tensor] = {}

    def keep_output(module, inputs, output):
        stored["layer 2"] = output

    model.layers[2].register_forward_hook(keep_output)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, (X,), budget=BUDGET, verbose=False)
        _steps(rm, ref, label="forward hook")
    assert rm.plan is not None and not rm.plan.fallback  # planned: the hook computes no tensor of the step
    warnings = [r.getMessage() for r in caplog.records if "forward hooks" in r.getMessage()]
    assert len(warnings) == 1 and "keep_output on layers.2" in warnings[0] and "traced values" in warnings[0]


def test_pytorch_s_own_hooks_plan_quietly_and_exactly(caplog):
    def build() -> nn.Module:  # twice: a module under spectral_norm refuses deepcopy
        model = Chain().double()
        prune.l1_unstructured(model.layers[1][0], "weight", amount=0.5)  # a forward pre-hook: weight = orig * mask
        torch.manual_seed(2)
        torch.nn.utils.spectral_norm(model.layers[4][0])  # a forward pre-hook updating its power-iteration buffers
        return model

    model, ref = build(), build()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, (X,), budget=BUDGET, verbose=False)
        _steps(rm, ref, n=3, label="prune, spectral norm")
    assert rm.plan is not None and not rm.plan.fallback
    assert not [r for r in caplog.records if "hooks" in r.getMessage()]
