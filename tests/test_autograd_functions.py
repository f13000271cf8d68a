"""A model's own torch.autograd.Functions keep their backward (NOTE [autograd Functions]): gradients are eager
PyTorch's, bitwise, where export alone recorded only their forward's ops and differentiated those."""
import copy

import pytest
import torch
from budgets import assert_same_grads_and_buffers
from torch import nn
from torch.autograd.function import once_differentiable

from remat_plugin import rematerialize


class RoundThrough(torch.autograd.Function):
    """A straight-through estimator: rounds forward, passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, x, step):
        return torch.round(x / step) * step

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReverseGradient(torch.autograd.Function):
    """Domain-adversarial training's gradient reversal: the identity forward, a scaled negation backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class ClippedSquare(torch.autograd.Function):
    """The new style (``setup_context``): a square whose gradient is clipped, unlike the square's derivative."""

    @staticmethod
    def forward(x, limit):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.limit = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return (grad * 2 * x).clamp(-ctx.limit, ctx.limit), None


class MaxWithIndex(torch.autograd.Function):
    """Two outputs, one of them not differentiable."""

    @staticmethod
    def forward(ctx, x):
        values, index = x.max(dim=-1, keepdim=True)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(index)
        ctx.width = x.shape[-1]
        return values, index

    @staticmethod
    def backward(ctx, grad_values, grad_index):
        (index,) = ctx.saved_tensors
        shape = (*index.shape[:-1], ctx.width)
        return torch.zeros(shape, dtype=grad_values.dtype).scatter(-1, index, grad_values * 0.5)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        h = torch.tanh(RoundThrough.apply(self.up(x), 0.25))
        h = ReverseGradient.apply(self.dropout(h), 0.5)
        h = ClippedSquare.apply(h, 0.3)
        return x + self.down(h)


class Model(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        values, index = MaxWithIndex.apply(self.head(x))
        return values.sum() + index.sum() * 0


X = torch.randn(512, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _planned_between(model: nn.Module, args: tuple = (X,), kwargs: dict | None = None):
    """``model`` planned halfway between its smallest feasible budget and its unmodified peak (some blocks
    recomputed), probed on a copy."""
    probe = rematerialize(copy.deepcopy(model), args, kwargs or {}, budget=2**30, verbose=False)
    assert probe.plan is not None
    budget = (probe.plan.min_feasible_bytes + probe.plan.baseline_peak_bytes) // 2
    rm = rematerialize(model, args, kwargs or {}, budget=budget, verbose=False)
    assert rm.plan is not None and not rm.plan.fallback
    return rm


def _steps(rm, ref: nn.Module, n: int = 2) -> None:
    for i in range(n):
        torch.manual_seed(10 + i)
        rm(X).backward()
        torch.manual_seed(10 + i)
        ref(X).backward()
        assert_same_grads_and_buffers(rm.original, ref, f"step {i}")
        rm.original.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


def test_functions_backward_is_their_own_at_a_budget_that_recomputes():
    model = Model().double()
    ref = copy.deepcopy(model)
    rm = _planned_between(model)
    assert any(b.mode != "keep" for b in rm.plan.blocks), rm.plan.table()
    _steps(rm, ref)


def test_a_function_that_changes_its_input_in_place():
    class AddOneInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.mark_dirty(x)
            return x.add_(1)

        @staticmethod
        def backward(ctx, grad):
            return grad * 0.5

    class Dirty(Model):
        def forward(self, x):
            for layer in self.layers:
                y = layer(x) * 1
                x = AddOneInPlace.apply(y) + y  # y read after the call: changed, as eager reads it
            return self.head(x).sum()

    model = Dirty().double()
    ref = copy.deepcopy(model)
    rm = _planned_between(model)
    _steps(rm, ref)


def test_bloom_trains_with_its_own_gelu_backward():
    transformers = pytest.importorskip("transformers")
    config = transformers.BloomConfig(vocab_size=128, hidden_size=32, n_layer=3, n_head=4, hidden_dropout=0.1,
                                      attention_dropout=0.1)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(config).double().train()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    rm = _planned_between(model, (), kwargs)
    for i in range(2):
        torch.manual_seed(i)
        rm(**kwargs).loss.backward()
        torch.manual_seed(i)
        ref(**kwargs).loss.backward()
        assert_same_grads_and_buffers(model, ref, f"bloom step {i}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert any(b.mode != "keep" for b in rm.plan.blocks), rm.plan.table()


class Float32Scale(torch.autograd.Function):
    """Runs in float32 under autocast (``custom_fwd(cast_inputs=...)``), its backward once differentiable."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @once_differentiable
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        return grad * 3


def test_custom_fwd_functions_under_bf16_autocast():
    class Cast(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(Float32Scale.apply(layer(x)))
            return x.float().square().mean()

    model = Cast()
    ref = copy.deepcopy(model)
    x = X.float()
    rm = rematerialize(model, budget=2**30, verbose=False)
    for i in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours, theirs = rm(x), ref(x)
        ours.backward()
        theirs.backward()
        assert_same_grads_and_buffers(model, ref, f"bf16 step {i}")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert rm.plan is not None and not rm.plan.fallback
