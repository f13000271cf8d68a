"""Op times carried to a new shape of the same graph instead of timed again (NOTE [op times across shapes])."""
from __future__ import annotations

import torch
from torch import nn

from remat_plugin.capture import measured_costs
from remat_plugin.capture.measured_costs import OpTimings
from remat_plugin.runtime.steps import capture_problem


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3, padding=1))


def _counting_timer(monkeypatch) -> list[str]:
    timed: list[str] = []
    real = measured_costs._time_op

    def counting(node, *args, **kwargs):
        timed.append(node.name)
        return real(node, *args, **kwargs)

    monkeypatch.setattr(measured_costs, "_time_op", counting)
    return timed


def test_a_new_batch_size_carries_times_and_measures_scratch_again(monkeypatch):
    net = _conv_net()
    timings = OpTimings()
    small, _ = capture_problem(net, (torch.randn(2, 8, 24, 24),), op_timings=timings)
    timed = _counting_timer(monkeypatch)
    large, _ = capture_problem(net, (torch.randn(4, 8, 24, 24),), op_timings=timings)
    assert timed == []  # every op carried from the batch of 2

    fresh, _ = capture_problem(net, (torch.randn(4, 8, 24, 24),))  # measured from scratch at batch 4
    assert timed  # the fresh capture did time its ops
    for op in large.ops:
        before, measured = small.op(op.name), fresh.op(op.name)
        if op.name.startswith("convolution") and op.is_fwd:
            assert 1.3 < op.time_ms / before.time_ms < 2.5, (op.name, before.time_ms, op.time_ms)
        # scratch is measured at the new sizes: the same bytes as a fresh capture, never the old ones carried
        assert op.temp_bytes == measured.temp_bytes, (op.name, before.temp_bytes, op.temp_bytes, measured.temp_bytes)
    assert any(op.temp_bytes > small.op(op.name).temp_bytes for op in large.ops if op.name.startswith("convolution"))


def test_another_graph_is_timed(monkeypatch):
    timings = OpTimings()
    capture_problem(_conv_net(), (torch.randn(2, 8, 24, 24),), op_timings=timings)
    other = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.Tanh(), nn.Conv2d(16, 8, 3, padding=1))
    timed = _counting_timer(monkeypatch)
    capture_problem(other, (torch.randn(4, 8, 24, 24),), op_timings=timings)
    assert any(name.startswith("convolution") for name in timed)  # not carried across graphs


def _scratch(problem) -> dict[str, int]:
    return {op.name: op.temp_bytes for op in problem.ops if op.temp_bytes}


def test_scratch_kept_under_a_profiler_is_read_by_the_next_capture_outside_one():
    """NOTE [scratch read later]: a carry made inside a profiler keeps the other shape's scratch, an op first
    measured there has none read; the next capture of those sizes outside a profiler reads both, as a fresh one,
    and so does a capture that carries the latter to other sizes."""
    net = _conv_net()
    fresh = _scratch(capture_problem(net, (torch.randn(2, 8, 24, 24),))[0])
    assert fresh
    carried = OpTimings()
    capture_problem(net, (torch.randn(4, 8, 24, 24),), op_timings=carried)
    first_inside = OpTimings()
    with torch.profiler.profile(profile_memory=True):
        inside_carried = _scratch(capture_problem(net, (torch.randn(2, 8, 24, 24),), op_timings=carried)[0])
        inside_new = _scratch(capture_problem(net, (torch.randn(2, 8, 24, 24),), op_timings=first_inside)[0])
    assert inside_carried != fresh and inside_new == {}  # batch 4's bytes, and none read
    carried_on = OpTimings()
    with torch.profiler.profile(profile_memory=True):
        capture_problem(net, (torch.randn(2, 8, 24, 24),), op_timings=carried_on)
    assert _scratch(capture_problem(net, (torch.randn(4, 8, 24, 24),), op_timings=carried_on)[0]) == \
        _scratch(capture_problem(net, (torch.randn(4, 8, 24, 24),))[0])  # carried on to batch 4: read there
    for timings in (carried, first_inside):
        assert _scratch(capture_problem(net, (torch.randn(2, 8, 24, 24),), op_timings=timings)[0]) == fresh
