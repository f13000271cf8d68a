"""Recurrent layers on CUDA (NOTE [recurrent layers in the trace] in ``remat_plugin/torch_private.py``).

Off CPU the trace runs torch._decomp's kernel one layer at a time, ``aten.dropout`` between the layers, where eager
runs cuDNN's fused multi-layer kernel: the planned step's gradients equal eager's within float64 rounding without
dropout, and with dropout they are drawn by torch's own generator (cuDNN draws its own masks), replayed exactly by
every recomputation."""
import copy

import pytest
import torch
import torch.nn.functional as F
from budgets import step_grads
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.ir.plan import budget_for_peak

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class RecurrentLM(nn.Module):
    def __init__(self, kind: type[nn.Module], dropout: float):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = kind(16, 24, num_layers=3, dropout=dropout, batch_first=True, bidirectional=True)
        self.head = nn.Linear(48, 50)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return F.cross_entropy(self.head(out).flatten(0, 1), ids.flatten())


def _batches(n: int = 2) -> list[tuple[torch.Tensor]]:
    return [(torch.randint(0, 50, (256, 10), device="cuda"),) for _ in range(n)]


def _recomputing(model, batch):
    """``model`` planned halfway between its smallest feasible budget and its unmodified peak (it recomputes)."""
    plan = rematerialize(copy.deepcopy(model), batch, {}, budget=10**12, verbose=False).plan
    budget = (budget_for_peak(plan.baseline_peak_bytes) + plan.min_feasible_bytes) // 2
    rm = rematerialize(model, batch, {}, budget=budget, verbose=False)
    assert not rm.plan.fallback and any(b.mode != "keep" for b in rm.plan.blocks), rm.plan.fallback
    return rm, budget


def _relative_error(ours, eager) -> float:
    num = sum(float((a - b).pow(2).sum()) for step_a, step_b in zip(ours, eager) for a, b in zip(step_a, step_b))
    den = sum(float(b.pow(2).sum()) for step in eager for b in step)
    return (num / den) ** 0.5


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_without_dropout_equal_to_cudnn_within_rounding_and_budget(kind):
    torch.manual_seed(0)
    model = RecurrentLM(kind, dropout=0.0).double().cuda().train()
    reference, batches = copy.deepcopy(model), _batches()
    rm, budget = _recomputing(model, batches[0])
    ours = step_grads(rm, batches, lambda loss: loss)
    error = _relative_error(ours, step_grads(reference, batches, lambda loss: loss))
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with PeakMeter("cuda") as meter:
        rm(*batches[0]).backward()
    print(f"{kind.__name__}: gradient rel. error {error:.2e}, peak {meter.peak_bytes} <= budget {budget}")
    assert error < 1e-12
    assert meter.peak_bytes <= budget


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU])
def test_dropout_between_layers_replayed_by_recomputation(kind):
    """The same seeds give the recomputing plan and the keep-everything plan the same masks, bitwise; and the
    dropout is there (the gradients are not those of the model without it)."""
    torch.manual_seed(0)
    model = RecurrentLM(kind, dropout=0.3).double().cuda().train()
    keep_all, no_dropout, batches = copy.deepcopy(model), copy.deepcopy(model), _batches()
    no_dropout.rnn.dropout = 0.0
    rm, _ = _recomputing(model, batches[0])
    recomputed = step_grads(rm, batches, lambda loss: loss)
    kept = step_grads(rematerialize(keep_all, batches[0], {}, budget=10**12, verbose=False), batches,
                      lambda loss: loss)
    without = step_grads(rematerialize(no_dropout, batches[0], {}, budget=10**12, verbose=False), batches,
                         lambda loss: loss)
    assert all(torch.equal(a, b) for step_a, step_b in zip(recomputed, kept) for a, b in zip(step_a, step_b))
    assert _relative_error(kept, without) > 1e-3
