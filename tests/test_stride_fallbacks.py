"""Values whose Meta kernel lays them out otherwise than the kernel that runs (NOTE [batch norm layouts],
NOTE [views of mistraced strides]): the traced views of them ran, and failed, at the step's first call."""
import logging

import pytest
import torch
from torch import nn

from budgets import assert_bitwise_at_a_recomputing_budget
from remat_plugin import rematerialize


class _ChannelNorm(nn.Module):
    """PatchTST's layer: a BatchNorm1d over the channels of a (batch, time, channels) tensor, transposed in and
    out, then a Linear (whose flattening the trace records as a view)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.proj, self.norm, self.head = nn.Linear(8, width), nn.BatchNorm1d(width), nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = self.norm(self.proj(x).transpose(1, 2)).transpose(1, 2)
        return x.new_zeros(()) + self.drop(torch.relu(self.head(h))).pow(2).mean()


class _TransposedPrediction(nn.Module):
    """PatchTST's head: the prediction is returned as (batch, channels, time), a transpose, and its mean-squared
    error is computed inside the model; CPU's ``mse_loss_backward`` is row-major where its Meta kernel keeps the
    prediction's strides."""

    def __init__(self):
        super().__init__()
        self.body, self.head = _ChannelNorm(), nn.Linear(8, 8)

    def forward(self, x, target):
        prediction = torch.tanh(self.head(self.body.proj(x)[..., :8] + x)).transpose(1, 2)
        return nn.functional.mse_loss(prediction, target) + self.body(x), prediction


def _copies(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "was copied" in r.getMessage()]


def test_a_batch_norm_over_a_transposed_tensor_is_traced_as_laid_out_and_trains_bitwise(caplog):
    """The Meta kernel kept the transposed input's strides where CPU's kernel writes row-major: the Linear's traced
    view failed ("view size is not compatible").  Traced as laid out, the plan needs no copy of it."""
    torch.manual_seed(0)
    model = _ChannelNorm().double()
    batches = [(torch.randn(4, 12, 8, dtype=torch.float64),) for _ in range(3)]
    with caplog.at_level(logging.DEBUG, logger="remat_plugin.capture.stride_fallbacks"):
        assert_bitwise_at_a_recomputing_budget(model, batches, loss=lambda out: out)
    assert not _copies(caplog)


def test_a_view_of_a_gradient_laid_out_otherwise_than_traced_is_copied_and_trains_bitwise(caplog):
    torch.manual_seed(0)
    model = _TransposedPrediction().double()
    batches = [(torch.randn(4, 12, 8, dtype=torch.float64), torch.randn(4, 8, 12, dtype=torch.float64))
               for _ in range(3)]
    with caplog.at_level(logging.DEBUG, logger="remat_plugin.capture.stride_fallbacks"):
        assert_bitwise_at_a_recomputing_budget(model, batches, loss=lambda out: out[0])
    assert _copies(caplog)


def test_patchtst_trains_bitwise_at_a_recomputing_budget():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.PatchTSTConfig(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8,
                                         d_model=16, num_attention_heads=2, num_hidden_layers=3, ffn_dim=32,
                                         prediction_length=8, dropout=0.1)
    model = transformers.PatchTSTForPrediction(config).double().train()
    batches = [dict(past_values=torch.randn(2, 32, 3, dtype=torch.float64),
                    future_values=torch.randn(2, 8, 3, dtype=torch.float64)) for _ in range(2)]
    assert_bitwise_at_a_recomputing_budget(model, batches)
