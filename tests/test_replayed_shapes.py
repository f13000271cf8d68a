"""A plan replayed on other inputs than it was made for: a smaller batch in its bucket, or the same shape with other
strides.  Gradients bitwise eager's; the replay's predicted peak is what the CPU allocator measures, kernel scratch
included (NOTE [temporary memory]); a call with other strides gets a step of its own (``Signature``)."""
import copy

import torch
from budgets import assert_same_grads_and_buffers
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.capture.memory_meter import measure_peak_profiler


def _conv_net() -> nn.Module:
    torch.manual_seed(0)

    def block(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())

    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), *[block(16) for _ in range(6)], nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 10)).double()


def _images(batch: int, seed: int, channels_last: bool = False) -> torch.Tensor:
    x = torch.randn(batch, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return x.to(memory_format=torch.channels_last) if channels_last else x


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().sum()


def _planned(net: nn.Module, x: torch.Tensor, share: float):
    whole = rematerialize(copy.deepcopy(net), (x,), budget=10**12, verbose=False).plan
    assert whole is not None
    rm = rematerialize(net, (x,), budget=int(whole.baseline_peak_bytes * share), verbose=False)
    assert rm.plan is not None and rm.plan.scratch_ops  # the convolutions' oneDNN scratch
    return rm


def _step_and_peak(rm, ref: nn.Module, x: torch.Tensor, label: str) -> int:
    """One step of each, gradients and buffers compared; then the planned step's allocator peak, metered."""
    _loss(rm, x).backward()
    _loss(ref, x).backward()
    assert_same_grads_and_buffers(rm.original, ref, label)
    rm.original.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    peak = measure_peak_profiler(lambda: _loss(rm, x).backward())[1]
    rm.original.zero_grad(set_to_none=True)
    return peak


def test_a_partial_batch_replays_the_plan_and_predicts_its_scratch():
    net = _conv_net()
    ref = copy.deepcopy(net)
    rm = _planned(net, _images(8, 0), share=0.7)
    solved = rm._resolver.n_solved
    x = _images(5, 1)  # the last, partial batch: served by the batch of 8's plan
    peak = _step_and_peak(rm, ref, x, "batch 5")
    assert rm._resolver.n_solved == solved and rm._resolver.n_replayed >= 1
    assert rm.plan is not None and "[5,3,32,32]" in rm.plan.signature
    # the simulator's check at batch 5 counts the convolutions' scratch measured at batch 5: it predicts the meter
    assert abs(peak - rm.plan.predicted_peak_bytes) <= 64 * 1024, (peak, rm.plan.predicted_peak_bytes)
    assert peak <= rm.plan.budget_bytes


def test_other_strides_of_the_same_shape_get_a_step_of_their_own():
    """A contiguous input's ``reshape`` traces as a ``view``, which a transposed input refuses: the transposed call
    must be traced for its own strides, and a ``channels_last`` model called with a contiguous input is predicted
    right."""

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(6))

        def forward(self, x):
            x = x.reshape(x.shape[0], -1)
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    net = Flat().double()
    ref = copy.deepcopy(net)
    x = torch.randn(512, 8, 8, dtype=torch.float64)
    whole = rematerialize(copy.deepcopy(net), (x,), budget=10**12, verbose=False).plan
    assert whole is not None
    rm = rematerialize(net, (x,), budget=int(whole.baseline_peak_bytes * 0.6), verbose=False)
    for label, t in (("contiguous", x), ("transposed", torch.randn(512, 8, 8, dtype=torch.float64).transpose(1, 2)),
                     ("contiguous again", x)):
        rm(t).square().sum().backward()
        ref(t).square().sum().backward()
        assert_same_grads_and_buffers(net, ref, label)
        net.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)

    conv = _conv_net().to(memory_format=torch.channels_last)
    conv_ref = copy.deepcopy(conv)
    rm = _planned(conv, _images(8, 0, channels_last=True), share=0.7)
    solved = rm._resolver.n_solved
    peak = _step_and_peak(rm, conv_ref, _images(8, 1), "contiguous")  # contiguous: the plan replayed at its strides
    assert rm._resolver.n_solved == solved and rm.plan is not None and "[8,3,32,32]" in rm.plan.signature
    assert abs(peak - rm.plan.predicted_peak_bytes) <= 64 * 1024, (peak, rm.plan.predicted_peak_bytes)
