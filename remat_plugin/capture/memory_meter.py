"""Peak-memory meter: how far allocated memory rises during a block above where it started.

This is the project's one meaning of a budget: the most that allocated
device memory rises during one forward+backward above what is allocated when the step starts.

- CUDA reads the caching allocator's counters: baseline ``memory_allocated()`` on entry,
  ``max_memory_allocated()`` after ``reset_peak_memory_stats()``.
- CPU has no such counters, so the meter tracks live tensor storages itself (see the note
  below). It sees every storage an ATen op returns, including those created by autograd
  during ``backward()`` run inside the block, and is exact and noise-free for those. It does
  not see memory allocated below the dispatcher: kernel scratch buffers (oneDNN convolution
  workspaces, about 0.75 MiB on bench resnet-tiny) and tensors C++ builds without an op (the
  5 KiB ``torch.get_rng_state()`` that ``torch.utils.checkpoint`` keeps per region). Where those
  matter, :func:`measure_peak_profiler` reads the CPU allocator itself.

NOTE [CPU storage tracking]
A ``TorchDispatchMode`` sees the outputs of every op. For each output tensor we look at its
``UntypedStorage``. A storage that is also the storage of one of the op's inputs is not new
(views, in-place ops, ``out=``), and neither is a storage we already track; anything else was
allocated by this op, so its ``nbytes`` is added to the running total. We free it again from a
``weakref.finalize`` on the storage's Python object: PyTorch preserves that object for as long
as the C++ storage lives (``tensor.untyped_storage()`` returns the same object every time, even
after every Python tensor is gone and only autograd holds the storage), so the finalizer fires
exactly when the memory is released. Entries are keyed by ``id()`` of the storage object, which
cannot be reused before the finalizer has removed the entry. A tracked storage that grows in
place (``resize_``, ``out=`` into a too-small tensor) is re-counted at its new size; a storage
from before the block that grows counts only its growth.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.profiler import ProfilerActivity, profile
from typing_extensions import Self  # a torch dependency; typing.Self needs Python 3.11

from remat_plugin.torch_private import FakeTensor, FunctionalTensor, TorchDispatchMode, pytree

__all__ = ["PeakMeter", "StorageTracker", "allocator_trace", "measure_peak", "measure_peak_profiler", "memory_profile",
           "warm_backward_workspaces"]


class StorageTracker(TorchDispatchMode):
    """Counts bytes of storages created by ops while the mode is active (NOTE [CPU storage tracking])."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self._device = device
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0
        # id(storage) -> (counted bytes, finalizer)
        self._entries: dict[int, tuple[int, weakref.finalize]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = {id(s): s.nbytes() for s in self._storages(pytree.tree_leaves((args, kwargs)))}
        out = func(*args, **kwargs)
        for storage in self._storages(pytree.tree_leaves(out)):
            key = id(storage)
            if key in self._entries:
                self._regrow(storage, self._entries[key][0])
            elif key in before:
                growth = storage.nbytes() - before[key]
                if growth > 0:
                    self._track(storage, growth)
            else:
                self._track(storage, storage.nbytes())
        return out

    def _storages(self, leaves: list[Any]) -> list[torch.UntypedStorage]:
        found = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) or leaf.device != self._device:
                continue
            if isinstance(leaf, (FakeTensor, FunctionalTensor)) or leaf.is_meta:
                continue  # tracing (torch.export, AOTAutograd) makes fake/functional tensors: no memory behind them
            try:
                found.append(leaf.untyped_storage())
            except (NotImplementedError, RuntimeError):
                continue  # sparse and other storage-less layouts
        return found

    def _track(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)
        finalizer = weakref.finalize(storage, self._release, key)
        with self._lock:
            self._entries[key] = (nbytes, finalizer)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _regrow(self, storage: torch.UntypedStorage, counted: int) -> None:
        nbytes = storage.nbytes()
        if nbytes <= counted:
            return
        key = id(storage)
        with self._lock:
            self._entries[key] = (nbytes, self._entries[key][1])
            self.live_bytes += nbytes - counted
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self.live_bytes -= entry[0]

    def detach_all(self) -> None:
        """Stop listening for frees; storages still alive stay counted in ``live_bytes``."""
        with self._lock:
            entries, self._entries = self._entries, {}
        for _, finalizer in entries.values():
            finalizer.detach()


class PeakMeter:
    """Context manager measuring the peak rise of allocated memory above its value on entry.

    After the block, ``peak_bytes`` is the most allocated memory rose above the baseline and
    ``end_bytes`` the rise still allocated at exit (what was created inside and is still alive).
    Meters nest: an inner meter measures its own block and the outer one still sees everything.
    """

    _cuda_active: ClassVar[list[PeakMeter]] = []  # open CUDA meters, so a nested reset keeps outer peaks

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"memory.PeakMeter: device {self.device} is not supported; use 'cpu' or 'cuda'.")
        self.peak_bytes = 0
        self.end_bytes = 0
        self._open = False
        self._tracker: StorageTracker | None = None
        self._baseline_bytes = 0
        self._max_before_reset_bytes = 0

    def __enter__(self) -> Self:
        if self._open:
            raise RuntimeError("memory.PeakMeter: this meter is already open; use a new PeakMeter for a nested block.")
        self._open = True
        if self.device.type == "cpu":
            self._tracker = StorageTracker(self.device)
            self._tracker.__enter__()
        else:
            self._enter_cuda()
        return self

    def __exit__(self, *exc: object) -> None:
        self._open = False
        if self.device.type == "cpu":
            assert self._tracker is not None
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(*exc)
            tracker.detach_all()
            self.peak_bytes = tracker.peak_bytes
            self.end_bytes = tracker.live_bytes
        else:
            self._exit_cuda()

    def _enter_cuda(self) -> None:
        torch.cuda.synchronize(self.device)
        for outer in PeakMeter._cuda_active:
            if outer.device == self.device:
                outer._max_before_reset_bytes = max(
                    outer._max_before_reset_bytes, torch.cuda.max_memory_allocated(self.device)
                )
        torch.cuda.reset_peak_memory_stats(self.device)
        self._baseline_bytes = torch.cuda.memory_allocated(self.device)
        self._max_before_reset_bytes = self._baseline_bytes
        PeakMeter._cuda_active.append(self)

    def _exit_cuda(self) -> None:
        torch.cuda.synchronize(self.device)
        PeakMeter._cuda_active.remove(self)
        max_bytes = max(self._max_before_reset_bytes, torch.cuda.max_memory_allocated(self.device))
        self.peak_bytes = max_bytes - self._baseline_bytes
        self.end_bytes = torch.cuda.memory_allocated(self.device) - self._baseline_bytes


def measure_peak(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """Run ``fn()`` under a :class:`PeakMeter`; return its result and the peak rise in bytes."""
    with PeakMeter(device) as meter:
        result = fn()
    return result, meter.peak_bytes


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 sent to /dev/null: kineto prints "USDT: ... profiler_start/stop" there from C++."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class _WarmWorkspaces(torch.autograd.Function):
    """Identity whose backward runs the matrix products a planned backward runs (recomputed forwards included)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        _run_products(x)  # this thread's workspaces: the forward's, and what a planned step runs here
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        _run_products(grad)  # autograd's device thread's
        return grad


def _run_products(like: torch.Tensor) -> None:
    w = torch.ones(16, 16, device=like.device, dtype=like.dtype)
    torch.addmm(w, w, w)  # cuBLASLt's workspace (a bias epilogue)
    torch.mm(w, w)  # cuBLAS's
    torch.bmm(w[None], w[None])


# NOTE [allocator slack]
#     CUDA's caching allocator serves a request of more than 1 MiB from a cached block up to 1 MiB larger
#     without splitting it, and counts the whole block as allocated (``max_memory_allocated`` included).
#     Which block a request meets depends on what the process freed before, so the same step, same plan,
#     measures differently from step to step: 976 KiB apart in two steps of an FSDP2 unit plan on an H200
#     (``tests/cuda``, 2026-11-26).  A metered step cannot see the next step's luck; this much is kept back
#     on CUDA besides the safety margin.  The CPU allocator returns what was asked for.
CUDA_ALLOCATOR_SLACK_BYTES = 2 << 20


def allocator_slack(device: torch.device | str) -> int:
    """Bytes kept back for the allocator's step-to-step variation on ``device`` (NOTE [allocator slack])."""
    return CUDA_ALLOCATOR_SLACK_BYTES if torch.device(device).type == "cuda" else 0


def warm_backward_workspaces(device: torch.device | str) -> None:
    """Allocate the cuBLAS workspaces of this thread and of autograd's backward thread, before anything is metered.

    cuBLAS keeps a workspace per thread and stream, allocated through the caching allocator at its first
    product there (32 MiB on Hopper).  A CUDA backward runs on autograd's own device thread, so the first
    backward of a process allocated it inside the first metered step (an H200 measured 31-33 MiB above the
    plan there, and only there), and calibration took that one-time block for the plan's.  The workspaces do
    not last the process: ``torch.cuda.empty_cache()`` releases them, and Lightning calls it when a fit ends.
    On an H200 each fit's first step rose 64 MiB more than its others, a plain fit after another as well, and
    with a warm-up made once per process a metered step in a second fit read 63 MiB the plan did not make.
    So this runs before every metered step: a few 16 x 16 products once the workspaces exist.  No-op off CUDA.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    with torch.enable_grad():
        for dtype in (torch.float32, torch.float64, torch.float16) + \
                ((torch.bfloat16,) if torch.cuda.is_bf16_supported() else ()):
            x = torch.zeros(16, 16, device=dev, dtype=dtype, requires_grad=True)
            torch.autograd.grad(_WarmWorkspaces.apply(x).sum(), x)
    torch.cuda.synchronize(dev)


@contextlib.contextmanager
def memory_profile(cuda: bool = False) -> Iterator[profile]:
    """A profiler session recording allocator events (CPU, and CUDA with ``cuda``).

    Only its start and stop are silenced (kineto's own lines on stderr at every session, which a
    user would see at every plan); whatever the profiled code prints still shows.
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities, profile_memory=True)
    with _native_stderr_silenced():
        prof.start()
    try:
        yield prof
    finally:
        with _native_stderr_silenced():
            prof.stop()


@dataclass(frozen=True)
class AllocatorTrace:
    """What a finished :func:`memory_profile` session saw: allocator events and named ranges.

    NOTE [frees from before the session]
        The profiler reports the free of a block allocated in an *earlier* profiled session
        as a negative event (a block from outside any session it ignores).  Summed naively,
        freeing the last step's gradients inside a metered step lowers the running total and
        hides that much of the step's own rise.  ``events`` therefore keeps only blocks
        allocated inside this session, matched by address.
    """

    events: tuple[tuple[float, int], ...]  # (time in µs, +bytes allocated / -bytes freed), by time
    ranges: dict[str, tuple[float, float]]  # record_function name -> (start, end) in µs

    def peak_rise(self, start: float = float("-inf"), end: float = float("inf")) -> tuple[int, int]:
        """Peak and final running total of the events in [start, end], from 0."""
        live = peak = 0
        lo = bisect.bisect_left(self.events, (start, -(1 << 62)))
        hi = bisect.bisect_right(self.events, (end, 1 << 62))
        for _, nbytes in self.events[lo:hi]:
            live += nbytes
            peak = max(peak, live)
        return peak, live


@dataclass(frozen=True)
class FreedAfter:
    """Where a block's unseen free (NOTE [unseen frees]) certainly happened: a block allocated inside a range
    named ``allocated_in`` (or ``allocated_in (name)``) is freed by the end of the next ``released_by (name)``
    range, when that range lies inside a range whose name starts with ``only_inside``."""

    allocated_in: str
    released_by: str
    only_inside: str


# The device timeline's categories in a Chrome trace: a ``record_function`` range appears there too, under the same
# name, as the span its kernels ran on the GPU (NOTE [host ranges]).
_DEVICE_CATEGORIES = frozenset({"gpu_user_annotation", "kernel", "gpu_memcpy", "gpu_memset"})


def allocator_trace(prof: profile, device: torch.device | str = "cpu", excluding: tuple[str, ...] = (),
                    freed_after: tuple[FreedAfter, ...] = ()) -> AllocatorTrace:
    """The allocator events of ``device`` in a finished session (NOTE [frees from before the session]).

    Read from the session's Chrome trace: only there do memory events carry the block address.
    ``excluding``: blocks allocated inside an op of one of these names are left out (with their frees).
    ``freed_after``: where blocks whose free the session missed were freed (NOTE [unseen frees]).

    NOTE [unseen frees]
        The profiler reports an allocator event only from a thread the session is on: the one that started
        it and those that take its state on for one task (autograd's, a collective backend's while it runs a
        collective).  A block whose last reference goes elsewhere is freed unseen and looks alive to the end
        of the session.  gloo's worker thread holds a finished all-gather's work, output buffer included,
        until its loop moves on: when FSDP2's backward drops the buffer first (right after copying it out),
        the free is gloo's and unseen (gpt2-tiny, 2 ranks under CPU contention: 2.46 or 6.03 MiB from a
        unit's backward to the step's end, in 6 of 300 steps).  So a block allocated at an address the trace still
        holds was freed before, at the latest then; and where the caller names it (``freed_after``), at the
        end of the range that released it.

    NOTE [host ranges]
        Allocator events are stamped on the host, when the allocation is asked for.  With CUDA recorded,
        each ``record_function`` range is in the trace twice under its name: the host's span, and the span
        its kernels later ran on the GPU.  Ranges are read from the host's alone.  Reading the GPU's (the
        later of the two, which a name-keyed table kept) put the host's next allocations inside an op's
        range while its kernel was still running: ``_log_softmax_backward_data`` on GPT-2 small's logits
        (8 x 1024 x 50,257) was given two logits (3.07 GiB) of scratch it never allocates, which the plan
        predicted above its measured peak and which raised its floor (an H200, torch 2.11).
    """
    dev = torch.device(device)
    kind = 1 if dev.type == "cuda" else 0  # the trace's "Device Type": c10::DeviceType
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)["traceEvents"]
    raw = sorted(
        (e["ts"], e["args"]["Bytes"], e["args"]["Addr"]) for e in trace
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == kind
        and (dev.index is None or e["args"].get("Device Id") in (dev.index, -1))
    )
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in trace
                   if e.get("ph") == "X" and str(e.get("cat", "")).lower() not in _DEVICE_CATEGORIES)
    inside = [(start, end) for start, end, name in spans if name in excluding]
    releases = [_ReleaseTimes(spans, rule) for rule in freed_after]
    mine: dict[int, tuple[int, float]] = {}  # address -> (bytes, when it was freed at the latest if unseen)
    events = []
    for t, nbytes, addr in raw:
        if nbytes > 0 and addr in mine:  # its block was freed unseen (NOTE [unseen frees])
            held, released = mine.pop(addr)
            events.append((min(released, t), -held))
        if nbytes > 0 and inside and _within(inside, t):
            continue
        if nbytes > 0:
            mine[addr] = (nbytes, min((r.after(t) for r in releases), default=float("inf")))
            events.append((t, nbytes))
        elif addr in mine:
            events.append((t, -mine.pop(addr)[0]))
    events += [(released, -held) for held, released in mine.values() if released != float("inf")]
    ranges = {name: (start, end) for start, end, name in spans}
    return AllocatorTrace(tuple(sorted(events)), ranges)


class _ReleaseTimes:
    """:class:`FreedAfter`'s answer for one trace: when a block allocated at ``t`` was freed at the latest."""

    def __init__(self, spans: list[tuple[float, float, str]], rule: FreedAfter):
        self._allocating = [(start, end, name[len(rule.allocated_in):]) for start, end, name in spans
                            if _named(name, rule.allocated_in)]
        outer = [(start, end) for start, end, name in spans if name.startswith(rule.only_inside)]
        self._releasing = [(start, end, name[len(rule.released_by):]) for start, end, name in spans
                           if _named(name, rule.released_by) and _within(outer, start)]

    def after(self, t: float) -> float:
        owners = [suffix for start, end, suffix in self._allocating if start <= t <= end]
        if not owners:
            return float("inf")
        return next((end for start, end, suffix in self._releasing if suffix == owners[-1] and start >= t),
                    float("inf"))


def _named(name: str, label: str) -> bool:
    """``name`` is ``label`` or ``label (something)``: how FSDP2 names a range per module."""
    return name == label or name.startswith(label + " (")


def _within(spans: list[tuple[float, float]], t: float) -> bool:
    """``t`` lies in one of ``spans`` (sorted by start)."""
    i = bisect.bisect_right(spans, (t, float("inf")))
    return any(start <= t <= end for start, end in spans[max(0, i - 8):i])


def measure_peak_profiler(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``fn()`` under the profiler; return its result and the CPU allocator's peak rise.

    Reads the allocator's own alloc/free reports (``profile_memory=True``), so it also sees
    code a dispatch mode cannot, such as torch.compile'd graphs (a dispatch mode makes them run eagerly). In
    eager runs it agrees with :class:`PeakMeter` to the byte, plus any kernel scratch buffers.
    """
    with memory_profile() as prof:
        result = fn()
    return result, allocator_trace(prof).peak_rise()[0]
