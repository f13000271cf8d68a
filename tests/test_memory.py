"""The memory meter against known allocation patterns and against the CPU allocator's own totals."""

import json
import threading

import pytest
import torch
from torch import nn

from remat_plugin.capture.memory_meter import (
    FreedAfter,
    PeakMeter,
    allocator_trace,
    measure_peak,
    measure_peak_profiler,
    memory_profile,
)

KiB, MiB = 1 << 10, 1 << 20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _mlp_step(net: nn.Module, x: torch.Tensor) -> None:
    net(x).square().mean().backward()


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.1))]
    return nn.Sequential(*layers), torch.randn(64, 256)


def test_known_pattern_peak_and_end():
    """1 MiB + 2 MiB, free 1 MiB, + 0.5 MiB: peak is 3 MiB and 2.5 MiB is still alive."""
    with PeakMeter() as meter:
        a = _bytes(MiB)
        b = _bytes(2 * MiB)
        del a
        c = _bytes(MiB // 2)
    assert meter.peak_bytes == 3 * MiB
    assert meter.end_bytes == 2 * MiB + MiB // 2
    del b, c


def test_views_and_inplace_do_not_count():
    """Views, in-place ops and detach share the storage they came from."""
    with PeakMeter() as meter:
        a = _bytes(MiB)
        views = [a[1:], a.view(1024, 1024), a.view(1024, 1024).t(), a.detach(), a.add_(1)]
    assert meter.peak_bytes == MiB
    del a, views


def test_storages_from_before_the_block_do_not_count():
    """Touching a tensor allocated before the block (views, in-place) adds nothing."""
    a = _bytes(MiB)
    with PeakMeter() as meter:
        a.mul_(2)
        a[:10].fill_(0)
        b = a.view(2, -1)
    assert meter.peak_bytes == 0
    assert meter.end_bytes == 0
    del b


def test_resize_growth_counts():
    """A storage grown in place by resize_ counts at its new size."""
    with PeakMeter() as meter:
        a = _bytes(MiB)
        a.resize_(3 * MiB)
    assert meter.peak_bytes == 3 * MiB
    del a


def test_out_argument_into_existing_tensor_does_not_count():
    """Writing into a preallocated tensor with out= allocates nothing new."""
    x, out = torch.randn(256, 256), torch.empty(256, 256)
    with PeakMeter() as meter:
        torch.mm(x, x, out=out)
    assert meter.peak_bytes == 0


def test_free_after_exit_does_not_change_results():
    """Tensors freed after the block leave the recorded numbers alone."""
    with PeakMeter() as meter:
        a = _bytes(MiB)
    del a
    assert (meter.peak_bytes, meter.end_bytes) == (MiB, MiB)


def test_backward_gradients_are_counted():
    """Parameter gradients created by backward inside the block stay in end_bytes."""
    net, x = _mlp()
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    with PeakMeter() as meter:
        _mlp_step(net, x)
    assert meter.end_bytes == param_bytes
    assert meter.peak_bytes > param_bytes


def test_mlp_peak_covers_saved_activations():
    """Everything autograd saves for backward is alive at once, so the peak is at least that."""
    net, x = _mlp()
    outside = {t.untyped_storage().data_ptr() for t in [x, *net.parameters()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in outside:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), PeakMeter() as meter:
        _mlp_step(net, x)
    assert sum(saved.values()) > 0
    assert meter.peak_bytes >= sum(saved.values())


def test_mlp_peak_agrees_with_cpu_allocator():
    """In eager mode the meter and the profiler's allocator totals agree to the byte."""
    net, x = _mlp()
    _mlp_step(net, x)  # warm-up: lazy init must not land in one measurement only
    for p in net.parameters():
        p.grad = None
    torch.manual_seed(1)
    _, meter_peak = measure_peak(lambda: _mlp_step(net, x))
    for p in net.parameters():
        p.grad = None
    torch.manual_seed(1)
    _, allocator_peak = measure_peak_profiler(lambda: _mlp_step(net, x))
    assert meter_peak > 0
    assert abs(meter_peak - allocator_peak) <= 0.01 * allocator_peak, (meter_peak, allocator_peak)


def test_allocator_meter_ignores_frees_of_blocks_from_an_earlier_session():
    """A block the profiler saw allocated in an earlier session and freed inside this one does not lower this
    session's peak (NOTE [frees from before the session]): last step's gradients freed at the top of a step."""
    held: list[torch.Tensor] = []
    measure_peak_profiler(lambda: held.append(_bytes(8 * MiB)))

    def step():
        held.clear()
        return _bytes(MiB)

    _, peak = measure_peak_profiler(step)
    assert peak == MiB


def _freed_on_another_thread(box: list) -> None:
    """Drop the last reference in ``box`` on a thread the profiler session is not on: the free goes unseen."""
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()


def test_a_free_the_session_does_not_see_is_placed_where_the_caller_says():
    """NOTE [unseen frees]: a block whose last reference goes on another thread looks alive to the end of the
    session; a FreedAfter rule puts its free at the end of the range that released it (FSDP2's backward
    copy-out, freed by gloo's thread)."""
    def step(box: list) -> None:
        with torch.profiler.record_function("gather (unit)"):
            box.append(_bytes(8 * MiB))
        with torch.profiler.record_function("backward_hook (unit)"), torch.profiler.record_function("copy_out (unit)"):
            pass
        _freed_on_another_thread(box)
        held.append(_bytes(KiB))  # from the heap, never where the 8 MiB block was mapped (NOTE [unseen frees]'s reuse)

    held: list[torch.Tensor] = []
    rule = FreedAfter("gather", "copy_out", only_inside="backward_hook")
    for freed_after, expected in (((), (8 * MiB + KiB,) * 2), ((rule,), (8 * MiB, KiB))):
        with memory_profile() as prof:
            step([])
        assert allocator_trace(prof, freed_after=freed_after).peak_rise() == expected
    outside = FreedAfter("gather", "copy_out", only_inside="forward_hook")  # that copy-out did not release it
    with memory_profile() as prof:
        step([])
    assert allocator_trace(prof, freed_after=(outside,)).peak_rise() == (8 * MiB + KiB,) * 2


class _Trace:
    """A finished session as a Chrome trace written by hand (the profiler's own schema)."""

    def __init__(self, events: list[tuple[float, int, int]], spans: list[tuple[str, str, float, float]] = ()):
        self._events = [{"name": "[memory]", "ph": "i", "ts": t, "args": {"Bytes": n, "Addr": addr, "Device Type": 0}}
                        for t, n, addr in events]
        self._events += [{"name": name, "cat": cat, "ph": "X", "ts": start, "dur": end - start}
                         for name, cat, start, end in spans]

    def export_chrome_trace(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"traceEvents": self._events}, f)


def test_a_block_allocated_at_a_live_address_ends_the_block_freed_unseen_there():
    """NOTE [unseen frees]: a second block at an address the trace still holds means the first was freed
    unseen; the trace counted both (gloo, FSDP2: 2.46 MiB more in one step of 80)."""
    trace = allocator_trace(_Trace([(1.0, 8 * MiB, 0xA0), (2.0, 2 * MiB, 0xB0), (3.0, 8 * MiB, 0xA0)]))
    assert trace.peak_rise() == (10 * MiB, 10 * MiB)


def test_a_range_is_read_from_the_host_not_from_the_gpu_span_of_the_same_name():
    """NOTE [host ranges]: with CUDA recorded, a record_function range is also in the trace as the span its kernels
    ran on the GPU, later.  An op that allocates only its output (4 MiB) while the host goes on to allocate and
    free the next op's inputs (8 MiB) during its kernel has no scratch; the GPU's span read 8 MiB
    (``_log_softmax_backward_data`` on GPT-2 small's logits: two logits, 3.07 GiB, an H200)."""
    events = [(12.0, 4 * MiB, 0xA0), (25.0, 8 * MiB, 0xB0), (35.0, -8 * MiB, 0xB0)]
    spans = [("op", "user_annotation", 10.0, 20.0), ("op", "gpu_user_annotation", 15.0, 40.0),
             ("a kernel", "kernel", 15.0, 40.0)]
    trace = allocator_trace(_Trace(events, spans))
    assert trace.ranges == {"op": (10.0, 20.0)}
    peak, end = trace.peak_rise(*trace.ranges["op"])
    assert (peak, end) == (4 * MiB, 4 * MiB)  # no scratch: what it holds at the end is its peak


def test_kernel_scratch_is_measured_per_op():
    """oneDNN's convolution scratch, invisible to a dispatch-mode meter, is each convolution's temp_bytes in the
    problem (NOTE [temporary memory]); ops that allocate only their outputs have none."""
    from remat_plugin.runtime.steps import capture_problem

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 16, 3, padding=1))
    problem, _ = capture_problem(net, (torch.randn(4, 16, 32, 32),))
    temps = {o.name: o.temp_bytes for o in problem.ops}
    assert any(t > 0 for n, t in temps.items() if n.startswith("convolution")), temps
    assert all(t == 0 for n, t in temps.items() if n.startswith(("relu", "threshold_backward"))), temps


def test_measure_peak_returns_result():
    """measure_peak hands back fn's result with the peak."""
    result, peak = measure_peak(lambda: torch.zeros(1000, dtype=torch.float64).sum().item())
    assert result == 0.0
    assert peak == 8000 + 8  # the buffer and the 0-d sum


def test_nested_meters():
    """An inner meter measures its own block; the outer one still sees the inner allocations."""
    with PeakMeter() as outer:
        a = _bytes(MiB)
        with PeakMeter() as inner:
            b = _bytes(2 * MiB)
            del b
        c = _bytes(MiB // 2)
    assert inner.peak_bytes == 2 * MiB
    assert inner.end_bytes == 0
    assert outer.peak_bytes == 3 * MiB
    assert outer.end_bytes == MiB + MiB // 2
    del a, c


def test_reentering_one_meter_raises():
    """The same meter cannot be open twice."""
    meter = PeakMeter()
    with meter, pytest.raises(RuntimeError, match="already open"), meter:
        pass


def test_meter_is_reusable_after_exit():
    """A closed meter can be entered again and starts from zero."""
    meter = PeakMeter()
    with meter:
        a = _bytes(MiB)
    with meter:
        b = _bytes(MiB // 2)
    assert meter.peak_bytes == MiB // 2
    del a, b


def test_unsupported_device_raises():
    """Devices other than cpu and cuda are refused with a message naming the fix."""
    with pytest.raises(ValueError, match="use 'cpu' or 'cuda'"):
        PeakMeter("meta")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_known_pattern_and_nesting():
    """On CUDA the allocator counters give the same figures, and nesting keeps the outer peak."""
    MiB_f32 = MiB // 4
    with PeakMeter("cuda") as outer:
        a = torch.empty(MiB_f32, device="cuda")
        b = torch.empty(2 * MiB_f32, device="cuda")
        del a
        with PeakMeter("cuda") as inner:
            c = torch.empty(MiB_f32 // 2, device="cuda")
    assert outer.peak_bytes == 3 * MiB
    assert inner.peak_bytes == MiB // 2
    assert outer.end_bytes == 2 * MiB + MiB // 2
    del b, c
