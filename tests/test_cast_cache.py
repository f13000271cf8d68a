"""A weight autocast casts at several uses (NOTE [autocast's cast cache]): eager casts it once per autocast block
and sums its uses' gradients in bf16; the plan's gradients are eager's, bit for bit, at a recomputing budget."""
import copy

import pytest
import torch
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.ir.plan import budget_for_peak

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}


class _Loop(nn.Module):
    """A Linear (weight and bias) applied four times, a residual between: its cast is cached by eager."""

    def __init__(self):
        super().__init__()
        self.inp, self.lin, self.out, self.drop = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 1), nn.Dropout(0.1)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(4):
            h = self.drop(torch.tanh(self.lin(h))) + h
        return self.out(h).float().pow(2).mean()


class _TwoCrops(nn.Module):
    """A backbone called on two crops of one batch in one forward (a contrastive or DINO-style step)."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 16))

    def forward(self, x):
        a, b = self.backbone(x[:, :32]), self.backbone(x[:, 16:])
        return (a.float() - b.float()).pow(2).mean()


def _steps(model, args, kwargs, loss, cache: bool, seeds=(0, 1)):
    """Training steps under CPU bf16 autocast (the backward after the block); each step's loss and gradients."""
    out = []
    for seed in seeds:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        with torch.autocast(**BF16, cache_enabled=cache):
            value = loss(model(*args, **kwargs))
        value.backward()
        out.append((value.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    return out


def _assert_eager_s(model, args, kwargs=None, loss=lambda out: out, cache: bool = True):
    kwargs = kwargs or {}
    reference = copy.deepcopy(model)
    with torch.autocast(**BF16, cache_enabled=cache):
        plan = rematerialize(copy.deepcopy(model), args, kwargs, budget=10**12, verbose=False).plan
        budget = (budget_for_peak(plan.baseline_peak_bytes) + plan.min_feasible_bytes) // 2
        rm = rematerialize(model, args, kwargs, budget=budget, verbose=False)
    assert not rm.plan.fallback and any(b.mode != "keep" for b in rm.plan.blocks), rm.plan.fallback
    for step, ((loss_ours, ours), (loss_eager, eager)) in enumerate(
            zip(_steps(rm, args, kwargs, loss, cache), _steps(reference, args, kwargs, loss, cache))):
        assert torch.equal(loss_ours, loss_eager), step
        assert len(ours) == len(eager)
        for i, (a, b) in enumerate(zip(ours, eager)):
            assert torch.equal(a, b), (step, i, (a - b).abs().max())


def test_a_linear_applied_in_a_loop_gets_eager_s_gradient():
    torch.manual_seed(0)
    _assert_eager_s(_Loop(), (torch.randn(16, 32),))


def test_a_backbone_called_on_two_crops_gets_eager_s_gradient():
    torch.manual_seed(0)
    _assert_eager_s(_TwoCrops(), (torch.randn(16, 48),))


def test_without_the_cache_each_use_is_cast_as_eager_casts_it():
    """``cache_enabled=False``: eager casts at every use and sums in fp32, and so does the plan."""
    torch.manual_seed(0)
    _assert_eager_s(_Loop(), (torch.randn(16, 32),), cache=False)


def test_albert_s_shared_layer_with_a_padded_mask_and_dropout():
    transformers = pytest.importorskip("transformers")
    config = transformers.AlbertConfig(vocab_size=100, embedding_size=16, hidden_size=32, num_hidden_layers=4,
                                       num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                       hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    torch.manual_seed(0)
    model = transformers.AlbertForMaskedLM(config)
    ids = torch.randint(0, 100, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    _assert_eager_s(model, (), {"input_ids": ids, "attention_mask": mask, "labels": ids}, loss=lambda out: out.loss)


class _OwnCasts(nn.Module):
    """A model that casts its weight itself at each use, which eager autocast never caches."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        h = x.bfloat16()
        for _ in range(3):
            h = torch.tanh(nn.functional.linear(h, self.lin.weight.to(torch.bfloat16)))
        return h.float().pow(2).mean()


def test_a_weight_the_model_casts_itself_keeps_a_cast_per_use():
    """Explicit casts are each their own cast in eager, their gradients summed in fp32: the plan keeps them so."""
    torch.manual_seed(0)
    model = _OwnCasts()
    reference = copy.deepcopy(model)
    x = torch.randn(16, 32)
    with torch.autocast(**BF16):
        rm = rematerialize(model, (x,), budget=10**12, verbose=False)
    for (_, ours), (_, eager) in zip(_steps(rm, (x,), {}, lambda out: out, True),
                                     _steps(reference, (x,), {}, lambda out: out, True)):
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))
