"""Calls made only to plan do not compute the forward (NOTE [planning runs] in capture/export.py), and change
nothing: buffers, RNG and the first real step are as if they had run."""
import pytest
import torch
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.capture import export
from remat_plugin.ir.plan import budget_for_peak


class _ConvBnDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(h.flatten(1)).logsumexp(-1).mean()


@pytest.fixture
def unrun_calls(monkeypatch):
    """How many times a forward program was skipped (its outputs made without running it)."""
    calls: list[int] = []
    original = export._unrun_outputs

    def counting(gm):
        unrun = original(gm)
        if unrun is None:
            return None

        def counted(args):
            calls.append(1)
            return unrun(args)

        return counted

    monkeypatch.setattr(export, "_unrun_outputs", counting)
    return calls


@pytest.mark.parametrize("share", [1.0, 0.6])
def test_prepare_skips_the_forward_and_the_first_step_is_eager(unrun_calls, share):
    """rematerialize() plans through one call whose forward program is not run; buffers and the RNG are
    untouched by it, and the first real step's loss, gradients and BatchNorm buffers equal eager's bitwise."""
    torch.manual_seed(0)
    model, ref = _ConvBnDropout().double(), _ConvBnDropout().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(16, 3, 8, 8, dtype=torch.float64)
    full = rematerialize(model, (x,), {}, budget=10**12).plan
    unrun_calls.clear()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)
    rng = torch.get_rng_state()
    top = budget_for_peak(full.baseline_peak_bytes)
    budget = int(full.min_feasible_bytes + share * (top - full.min_feasible_bytes))
    rm = rematerialize(model, (x,), {}, budget=budget)
    assert unrun_calls == [1]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    losses = []
    for m in (rm, ref):
        torch.manual_seed(1)
        loss = m(x)
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), name


def test_a_callers_step_runs_the_forward(unrun_calls):
    """A plan made lazily by the caller's own first call computes that call's forward: nothing is skipped."""
    torch.manual_seed(0)
    model, ref = _ConvBnDropout().double(), _ConvBnDropout().double()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(16, 3, 8, 8, dtype=torch.float64)
    from remat_plugin.runtime.module import RematModule

    rm = RematModule(model, budget=10**12)
    losses = []
    for m in (rm, ref):
        torch.manual_seed(1)
        losses.append(m(x).detach())
    assert unrun_calls == []
    assert torch.equal(losses[0], losses[1])
