"""Models that checkpoint themselves with ``torch.utils.checkpoint`` (their own code, or HF's gradient checkpointing),
planned by the plain API: the plan decides what is recomputed, the gradients are eager PyTorch's."""
import copy

import pytest
import torch
from budgets import assert_same_grads_and_buffers
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GPT2Config, GPT2LMHeadModel

from remat_plugin import CaptureError, rematerialize


class _Checkpointed(nn.Module):
    """Four residual MLP blocks, each run under ``checkpoint`` (reentrant or not), dropout on."""

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64)) for _ in range(4))
        self.use_reentrant = use_reentrant

    def forward(self, x):
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.use_reentrant)
        return x.square().mean()


def _same_step(rm, mine: nn.Module, ref: nn.Module, make_inputs, seed: int) -> None:
    args, kwargs = make_inputs()
    ref_args, ref_kwargs = copy.deepcopy((args, kwargs))
    torch.manual_seed(seed)
    ours = rm(*args, **kwargs)
    ours = ours if isinstance(ours, torch.Tensor) else ours.loss
    ours.backward()
    torch.manual_seed(seed)
    theirs = ref(*ref_args, **ref_kwargs)
    theirs = theirs if isinstance(theirs, torch.Tensor) else theirs.loss
    theirs.backward()
    assert torch.equal(ours, theirs)
    assert_same_grads_and_buffers(mine, ref, f"step {seed}")
    for got, want in zip([*args, *kwargs.values()], [*ref_args, *ref_kwargs.values()]):
        if isinstance(got, torch.Tensor) and got.requires_grad:
            assert torch.equal(got.grad, want.grad)
    mine.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_a_model_checkpointing_itself_is_planned_with_eager_gradients(use_reentrant):
    """Both forms of torch.utils.checkpoint are captured and planned (the reentrant one used to leave nothing to plan
    and failed an assertion); float64, dropout on, halfway from the floor to the unmodified peak (recomputing): losses, parameter and input
    gradients bitwise eager PyTorch's over two steps."""
    torch.manual_seed(0)
    mine = _Checkpointed(use_reentrant).double()
    ref = copy.deepcopy(mine)

    def make_inputs():
        return (torch.randn(512, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                            requires_grad=True),), {}

    probe = rematerialize(copy.deepcopy(mine), *make_inputs(), budget=10**12, verbose=False).plan
    budget = (probe.baseline_peak_bytes + probe.min_feasible_bytes) // 2  # between the floor and the peak
    rm = rematerialize(mine, *make_inputs(), budget=budget, verbose=False)
    assert rm.plan.fallback is None and rm.plan.predicted_peak_bytes <= rm.plan.budget_bytes
    assert any(b.mode != "keep" for b in rm.plan.blocks), rm.plan.table()
    for seed in range(2):
        _same_step(rm, mine, ref, make_inputs, seed)


def test_hf_reentrant_gradient_checkpointing_is_planned_with_eager_gradients():
    """GPT-2 with ``gradient_checkpointing_enable(use_reentrant=True)`` (older training scripts' setting): planned, not
    a failed assertion; float64, dropout on: losses and gradients bitwise eager PyTorch's with the same setting."""
    torch.manual_seed(0)
    mine = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=200, n_positions=64,
                                      use_cache=False)).double().train()
    ref = copy.deepcopy(mine)
    for m in (mine, ref):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 200, (4, 32), generator=torch.Generator().manual_seed(0))
    rm = rematerialize(mine, (), {"input_ids": ids, "labels": ids}, budget="1GiB", verbose=False)
    assert rm.plan.fallback is None
    for seed in range(2):
        _same_step(rm, mine, ref, lambda: ((), {"input_ids": ids, "labels": ids}), seed)


def test_nothing_to_differentiate_is_a_clear_error():
    """Reentrant checkpointing whose input does not require grad gives its parameters no gradient (eager's loss
    cannot be differentiated either): planning says so and names the fixes, instead of a bare assertion."""
    torch.manual_seed(0)
    model = _Checkpointed(use_reentrant=True).double()
    with pytest.raises(CaptureError, match="returns no tensor that requires grad.*use_reentrant=False"):
        rematerialize(model, (torch.randn(32, 64, dtype=torch.float64),), budget="1GiB", verbose=False)
