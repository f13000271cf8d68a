"""How often profiling runs an op: its one profiled run (reading its scratch) is also its warm-up
(NOTE [one warm-up] in remat_plugin.capture.measured_costs)."""
from __future__ import annotations

import time

import torch
from torch import nn

from remat_plugin.runtime.steps import capture_problem

_RUNS: list[int] = []


@torch.library.custom_op("remat_plugin_test::slow_double", mutates_args=())
def _slow_double(x: torch.Tensor) -> torch.Tensor:
    _RUNS.append(1)
    time.sleep(0.002)  # 3 timed runs pass the timer's 2 ms: it stops there
    return x * 2


@_slow_double.register_fake
def _(x):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return grad * 2


_slow_double.register_autograd(_backward)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.tanh(_slow_double(self.a(x)))).sum()


def test_a_new_op_runs_once_profiled_then_three_timed_runs():
    _RUNS.clear()
    problem, _ = capture_problem(_Net(), (torch.randn(4, 16),))
    assert [op.name for op in problem.ops if "slow_double" in op.name] == ["slow_double"]  # its forward, once
    # one profiled run (its scratch, and the warm-up of the timing), then the median of 3 timed runs
    assert len(_RUNS) == 4, len(_RUNS)
