"""A forward that writes into a tensor it is given (NOTE [inputs written by the forward] in
``remat_plugin/capture/forward_effects.py``): the runs made only to plan or to meter a step leave it as it was, so every
caller's step writes into it once, as eager does, and computes eager's loss and gradients."""
from __future__ import annotations

import copy

import torch
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.capture.export import export_module
from remat_plugin.capture.forward_effects import MUTATED_INPUTS_META
from remat_plugin.runtime.config import RematConfig
from remat_plugin.runtime.session import RematSession


class ScalesItsMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x, mask, extra=None):
        mask[:, :4].mul_(2)  # a write through a view
        if extra is not None:
            extra["count"].add_(1)
        return (self.linear(x) * mask).tanh().sum()


def _steps(model, x, n: int = 3):
    """n training steps, each on a fresh all-ones mask; each step's loss, gradients and mask after it."""
    out = []
    for _ in range(n):
        model.zero_grad(set_to_none=True)
        mask = torch.ones(4, 8, dtype=torch.float64)
        loss = model(x, mask)
        loss.backward()
        out.append((loss.detach(), [p.grad.clone() for p in model.parameters()], mask))
    return out


def _assert_like_eager(planned, reference, x):
    for (loss, grads, mask), (loss_e, grads_e, mask_e) in zip(_steps(planned, x), _steps(reference, x)):
        assert torch.equal(mask, mask_e) and mask[0, 0].item() == 2.0  # written once, not once more per metering
        assert torch.equal(loss, loss_e) and all(torch.equal(a, b) for a, b in zip(grads, grads_e))


def test_rematerialize_writes_the_input_once_per_step():
    torch.manual_seed(0)
    model = ScalesItsMask().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    mask = torch.ones(4, 8, dtype=torch.float64)
    planned = rematerialize(model, (x, mask), {}, budget=10**12, verbose=False)
    assert torch.equal(mask, torch.ones_like(mask))  # planning left it as it was
    _assert_like_eager(planned, reference, x)


def test_a_session_planning_inside_the_call_writes_the_input_once():
    torch.manual_seed(0)
    model = ScalesItsMask().double()
    reference = copy.deepcopy(model)
    session = RematSession(model, RematConfig(budget=10**12, ilp_time_limit_s=0.2))
    model.forward = session.dispatcher(model.forward)
    _assert_like_eager(model, reference, torch.randn(4, 8, dtype=torch.float64))
    assert session.n_solved >= 1


def test_the_written_inputs_are_found_by_their_flat_position():
    x, mask, count = torch.randn(4, 8), torch.ones(4, 8), torch.zeros(())
    gm = export_module(ScalesItsMask(), (x, mask), {"extra": {"count": count, "unused": torch.zeros(2)}})
    assert gm.meta[MUTATED_INPUTS_META] == {1, 2}
