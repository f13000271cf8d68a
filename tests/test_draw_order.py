"""Random fills of a transposed tensor draw as eager draws them (NOTE [draw order]): each element the same draw."""
import copy

import pytest
import torch
from budgets import assert_same_grads_and_buffers
from torch import nn

from remat_plugin import rematerialize


class _TransposedDraws(nn.Module):
    """A random op over a transposed tensor: SegFormer's and PatchTST's BatchNorm output, transposed back."""

    def __init__(self, draw: str, width: int = 16):
        super().__init__()
        self.draw = draw
        self.proj, self.norm, self.head = nn.Linear(width, width), nn.BatchNorm1d(width), nn.Linear(width, width)

    def forward(self, x):
        h = torch.relu(self.norm(self.proj(x).transpose(1, 2)).transpose(1, 2))
        if self.draw == "dropout":
            h = nn.functional.dropout(h, 0.3, True)
        elif self.draw == "dropout_":
            h = nn.functional.dropout(h * 1.0, 0.3, True, inplace=True)
        elif self.draw == "alpha_dropout":
            h = nn.functional.alpha_dropout(h, 0.3, True)
        elif self.draw == "bernoulli_":
            h = h * torch.empty_like(h).bernoulli_(0.7)
        return self.head(h).float().square().mean()


def _steps_bitwise(model, x, autocast=False):
    reference = copy.deepcopy(model)
    context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with context:
        planned = rematerialize(model, (x,), budget=10**12, verbose=False)
    for seed in range(3):
        losses = []
        for module in (planned, reference):
            torch.manual_seed(seed)
            with context:
                loss = module(x)
            loss.backward()
            losses.append(loss)
        assert torch.equal(*losses), (seed, losses)
        assert_same_grads_and_buffers(model, reference, f"step {seed}")
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)


@pytest.mark.parametrize("draw", ["dropout_", "alpha_dropout", "bernoulli_"])
def test_in_place_draws_over_a_transposed_tensor_are_eager_s(draw):
    """float64: eager fills ``empty_like(h)`` in ``h``'s memory order; the trace's functional ``bernoulli`` drew
    row-major, another mask than eager's at every step."""
    torch.manual_seed(0)
    _steps_bitwise(_TransposedDraws(draw).double(), torch.randn(4, 12, 16, dtype=torch.float64))


@pytest.mark.parametrize("autocast", [False, True])
def test_a_reduced_precision_dropout_over_a_transposed_tensor_draws_eager_s_mask(autocast):
    """CPU dropout in bf16 is eager's noise multiply (``empty_like(x).bernoulli_``): bf16 weights, or float32
    weights under bf16 autocast, every step's loss and gradients bitwise."""
    torch.manual_seed(0)
    model = _TransposedDraws("dropout")
    x = torch.randn(4, 12, 16)
    if not autocast:
        model, x = model.bfloat16(), x.bfloat16()
    _steps_bitwise(model, x, autocast)
