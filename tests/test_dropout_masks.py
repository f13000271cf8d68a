"""CPU dropouts planned as a random mask and a multiply (NOTE [dropout masks] in remat_plugin.capture.dropout_masks)."""
from __future__ import annotations

import copy

import pytest
import torch
from budgets import assert_same_grads_and_buffers
from torch import nn

import remat_plugin.capture.dropout_masks  # noqa: F401 -- registers the ops
from remat_plugin import rematerialize
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.runtime.steps import capture_problem


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_mask_and_multiply_are_the_cpu_kernel_bit_for_bit(dtype, p, layout):
    x = torch.randn(4, 3, 17, 9, dtype=dtype)
    if layout == "permuted":
        x = x.permute(2, 0, 3, 1)
    torch.manual_seed(7)
    out, mask = torch.ops.aten.native_dropout(x, p, True)
    after = torch.rand(5)
    torch.manual_seed(7)
    mine = torch.ops.remat_plugin.dropout_mask(x, p)
    applied = torch.ops.remat_plugin.apply_dropout_mask(x, mine, p)
    assert torch.equal(mine, mask) and mine.dtype == mask.dtype and mine.stride() == mask.stride()
    assert torch.equal(applied, out) and applied.stride() == out.stride()
    assert torch.equal(torch.signbit(applied), torch.signbit(out))  # zeros of negative inputs stay -0.0
    assert torch.equal(torch.rand(5), after)  # the generator is left where the kernel leaves it
    grad = torch.randn_like(x)
    scale = 1.0 / (1.0 - p)
    want = torch.ops.aten.native_dropout_backward(grad, mask, scale)
    got = torch.ops.remat_plugin.dropout_mask_backward(grad, mine, scale)
    assert torch.equal(got, want) and got.stride() == want.stride()
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    # a gradient laid out otherwise than the mask: the product takes the kernel's layout
    other = torch.randn(tuple(reversed(x.shape)), dtype=dtype).permute(*reversed(range(x.dim())))
    other[0].fill_(float("-inf"))  # -inf * 0 is nan, -inf * 1 stays -inf: as the kernel computes them
    want = torch.ops.aten.native_dropout_backward(other, mask, scale)
    got = torch.ops.remat_plugin.dropout_mask_backward(other, mine, scale)
    assert torch.equal(got.isnan(), want.isnan()) and got.stride() == want.stride()
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(torch.signbit(got), torch.signbit(want))


class _Mlp(nn.Module):
    def __init__(self, width: int = 64, layers: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Dropout(0.2), nn.Linear(4 * width, width),
                          nn.Dropout(0.1)) for _ in range(layers))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def test_a_plan_keeps_masks_and_recomputes_outputs_with_exact_gradients():
    torch.manual_seed(0)
    module = _Mlp().double()
    reference = copy.deepcopy(module)
    x = torch.randn(64, 32, 64, dtype=torch.float64)
    full = rematerialize(copy.deepcopy(module), (x,), budget=10**12, verbose=False).plan
    budget = int(full.baseline_peak_bytes * 0.6)
    rm = rematerialize(module, (x,), budget=budget, verbose=False)
    problem, schedule = rm.problem, rm.plan.schedule
    assert not any(o.name.startswith("native_dropout") for o in problem.ops)  # its backward too
    assert sum(o.name.startswith("dropout_mask_backward") for o in problem.ops) == 8
    applies = {o.name: o.inputs for o in problem.fwd_ops if o.name.startswith("apply_dropout_mask")}
    masks = {v: o.name for o in problem.fwd_ops if o.name.startswith("dropout_mask") and not o.name.endswith("__rng")
             for v in o.outputs}
    assert len(applies) == len(set(masks.values())) == 8
    recomputed = set(schedule)  # the plan's backward sequence
    # an output made again by its multiply alone, its mask kept from the forward: no draw repeated
    assert any(name in recomputed and not {masks[v] for v in inputs if v in masks} & recomputed
               for name, inputs in applies.items()), schedule
    # the multiplies write into the converted mask: no scratch beside their output (the draws keep theirs)
    scratch = dict(rm.plan.scratch_ops)
    assert any(name.startswith("dropout_mask_default") for name in scratch), scratch
    assert not [name for name in scratch if name.startswith(("apply_dropout_mask", "dropout_mask_backward"))], scratch
    for seed in range(3):
        for m in (rm, reference):
            m.zero_grad(set_to_none=True)

        def step():
            torch.manual_seed(seed)
            rm(x).backward()

        _, peak = measure_peak_profiler(step)
        torch.manual_seed(seed)
        reference(x).backward()
        assert_same_grads_and_buffers(rm, reference, f"step {seed}")
        assert peak <= budget, (peak, budget)


def test_reduced_precision_dropouts_are_left_as_traced():
    """bf16 dropout on CPU is traced as its own draws (bernoulli) and multiply: nothing is rewritten."""
    torch.manual_seed(0)
    problem, _ = capture_problem(_Mlp(layers=1).bfloat16(), (torch.randn(8, 4, 64, dtype=torch.bfloat16),))
    names = [o.name for o in problem.ops]
    assert any(n.startswith("bernoulli") for n in names)
    assert not any(n.startswith(("dropout_mask", "apply_dropout_mask")) for n in names)
