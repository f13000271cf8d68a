"""Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) trained through a plan keep their dropout between layers
(NOTE [recurrent layers in the trace] in ``remat_plugin/torch_private.py``): torch._decomp's kernels, which the
trace used to run, drop it, and the planned step trained another model."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from budgets import assert_bitwise_at_a_recomputing_budget, step_grads
from torch import nn

from remat_plugin import CaptureError, rematerialize, torch_private


class RecurrentLM(nn.Module):
    def __init__(self, kind: type[nn.Module], bidirectional: bool = False):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = kind(16, 24, num_layers=3, dropout=0.3, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(24 * (2 if bidirectional else 1), 50)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return F.cross_entropy(self.head(out).flatten(0, 1), ids.flatten())


def _batches(n: int = 2) -> list[tuple[torch.Tensor]]:
    return [(torch.randint(0, 50, (4, 10)),) for _ in range(n)]


@pytest.mark.parametrize("kind,bidirectional", [(nn.LSTM, False), (nn.LSTM, True), (nn.RNN, True)])
def test_multi_layer_dropout_is_bitwise_eager(kind, bidirectional):
    torch.manual_seed(0)
    model = RecurrentLM(kind, bidirectional).double().train()
    batches = _batches()
    assert_bitwise_at_a_recomputing_budget(model, batches, loss=lambda loss: loss)


def _max_difference(model, batches) -> float:
    reference = copy.deepcopy(model)
    planned = rematerialize(model, batches[0], {}, budget=10**12, verbose=False)
    ours, eager = step_grads(planned, batches, lambda loss: loss), step_grads(reference, batches, lambda loss: loss)
    return max((a - b).abs().max().item() for step_a, step_b in zip(ours, eager) for a, b in zip(step_a, step_b))


def test_gru_and_float32_lstm_keep_their_dropout():
    """A GRU (float64: its gates round otherwise, 1 ulp) and a float32 LSTM (eager's oneDNN layer) are not bitwise
    eager's, but their dropout between layers is drawn as eager draws it: the gradients differ in rounding only
    (they were 1e-3 off with the dropout dropped)."""
    torch.manual_seed(0)
    gru = RecurrentLM(nn.GRU, bidirectional=True).double().train()
    assert _max_difference(gru, _batches()) < 1e-15
    torch.manual_seed(0)
    lstm = RecurrentLM(nn.LSTM).float().train()
    assert _max_difference(lstm, _batches()) < 1e-7


def test_layer_by_layer_kernel_off_cpu_keeps_the_dropout(monkeypatch):
    """Off CPU the trace runs torch._decomp's kernel one layer at a time with the dropout between layers; run here
    on CPU, it matches eager bitwise (an LSTM with projections, bidirectional, given its states)."""
    monkeypatch.setattr(torch_private, "_RECURRENT_IN_EAGER_KERNEL", ())

    class Projected(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(6, 8, num_layers=3, dropout=0.4, proj_size=4, bidirectional=True)

        def forward(self, x, h, c):
            return self.rnn(x, (h, c))[0].pow(2).mean()

    torch.manual_seed(0)
    model = Projected().double().train()
    batches = [(torch.randn(5, 3, 6, dtype=torch.float64), torch.randn(6, 3, 4, dtype=torch.float64),
                torch.randn(6, 3, 8, dtype=torch.float64)) for _ in range(2)]
    assert _max_difference(model, batches) == 0.0


class PackedTagger(nn.Module):
    """Padded sequences packed by their lengths, as older NLP code feeds a recurrent layer."""

    def __init__(self, kind: type[nn.Module], with_state: bool):
        super().__init__()
        self.rnn = kind(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)
        self.with_state = with_state

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        state = torch.zeros(2, x.shape[0], 16) if self.with_state else None
        if state is not None and isinstance(self.rnn, nn.LSTM):
            state = (state, state)
        out, _ = self.rnn(packed, state)
        return self.head(nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0])


@pytest.mark.parametrize("kind,with_state", [(nn.LSTM, False), (nn.GRU, True)])
def test_a_packed_sequence_is_refused_with_the_fix(kind, with_state):
    """Its batch sizes come from the lengths' values: refused, naming PackedSequence and what to do instead."""
    model = PackedTagger(kind, with_state)
    with pytest.raises(CaptureError, match=r"PackedSequence holds its batch sizes.*run the recurrent layer on the "
                                           r"padded batch.*or train this model unplanned"):
        rematerialize(model, (torch.randn(3, 6, 8), torch.tensor([6, 2, 4])), budget=10**12, verbose=False)
