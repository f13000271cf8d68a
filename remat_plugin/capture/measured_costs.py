"""Per-op costs measured on the inputs' device, one op at a time: time and temporary memory.

Profiling never runs the whole unmodified step (the model may not fit): each op runs
alone, reading the step's real parameters, buffers and inputs where it only reads them
(no copy of an LM head's weight) and fresh tensors shaped like its real inputs for
everything else, so the most it adds is one op's activations and outputs.  Ops with the
same target, argument shapes and constants share one measurement, which is how identical
blocks are profiled once.

NOTE [temporary memory]
    Some kernels allocate scratch below the dispatcher: oneDNN convolutions on CPU, cuDNN/cuBLAS
    workspaces and flash-attention's backward on CUDA.  A dispatch-mode view of the step sees only
    op outputs, so a plan could fit on paper and exceed its budget at the allocator.  Each op's
    ``temp_bytes`` is the allocator's peak while it runs minus what it holds when it returns, read
    from the profiler's memory events of the op's device (one profiled run per distinct op; the
    CUDA caching allocator reports there too).  Unlike ``max_memory_allocated`` this resets no
    peak statistics the user may be reading.  The simulator and the block ILP add it to the
    memory while the op runs.

NOTE [one warm-up]
    Each newly measured op first runs once under the profiler to read its scratch, then its timed
    runs (at least 3, the median kept) follow without another warm-up: the profiled run was it.  A
    big op ran five times before (a warm-up, 3 timed, the profiled one), now four: gpt2-tiny's
    profiling, most of it its large matmuls and dropout masks, took 1.2-1.4 s of a 5 s cold plan
    on a slow 2-core CPU before and 0.9-1.1 s after (4 interleaved cold plans each, 2026-11-27).
    Under a caller's profiler nothing is profiled, and the timer warms up itself.

NOTE [op times across shapes]
    A new batch size or sequence length traces the same graph (the same ops under the same names,
    :attr:`JointGraph.structure_key`) at new sizes.  Its sizes come from the trace, exact.  Its op
    times are carried from the shape measured before, each scaled by how much more work the op does
    at the new sizes (FLOPs and bytes moved, :mod:`remat_plugin.capture.op_work`), instead of timing
    every op again: on gpt2-tiny, 8x128 scaled to 8x256 sums within 10% of measuring, and per op
    about as close as two measurements of the same shape are to each other.  Scratch is measured
    again for each op that had some at the shape measured (it grows with the op); an op that had
    none is taken to have none, and the metered first step (NOTE [calibration]) corrects a plan
    where that is wrong.  Carried costs are kept by op signature too, so another graph at the same
    sizes (the re-plan for outputs the caller drops) takes the same numbers and its plan is judged
    like the first; only measurements are carried on to further shapes.  Under a profiler (a re-plan
    inside the caller's ``torch.profiler``) scratch cannot be read, and a carried op keeps the
    scratch of the shape measured.

NOTE [scratch read later]
    Costs taken under a profiler keep scratch that was not read at their sizes: 0 for an op measured
    there, the other shape's bytes for a carried one.  They are marked, and the next capture outside a
    profiler that meets them reads their scratch and keeps that instead; one that carries such an op to
    other sizes reads its scratch there, though none was seen.  Before, they stood for the
    rest of the process: gpt2-tiny planned at 8x128, then at 4x128 inside a profiler, gave every later
    4x128 plan twice the dropout draws' scratch (8x128's bytes), outside a profiler too.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import fx
from torch.profiler import record_function

from remat_plugin.capture.joint import JointGraph, is_view_target
from remat_plugin.capture.memory_meter import allocator_trace, memory_profile
from remat_plugin.capture.op_work import work_ms
from remat_plugin.torch_private import OpOverload, profiler_active, unset_fake_temporarily

log = logging.getLogger(__name__)

# Scratch below this is taken as 0: a few bytes (a 12-byte scalar buffer in many elementwise ops) only put
# tiny coefficients into the block ILP's memory rows, which made HiGHS twice as slow on a Llama layer; scratch
# is transient, one op's at a time, so what is dropped is always far inside the plan's margin (>= 64 KiB).
MIN_TEMP_BYTES = 4096


@dataclass(frozen=True)
class OpCosts:
    time_ms: dict[str, float]
    temp_bytes: dict[str, int]


def op_signature(node: fx.Node) -> tuple:
    def describe(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if isinstance(v, torch.Tensor):
                return ("T", tuple(v.shape), tuple(v.stride()), v.dtype, str(v.device))
            return ("N", repr(v))
        if isinstance(a, (list, tuple)):
            return tuple(describe(x) for x in a)
        return repr(a)

    return (str(node.target), describe(node.args), tuple(sorted((k, describe(v)) for k, v in node.kwargs.items())))


# Generated inputs are filled by copying from one block of normal samples (tiled), made once per profile
# pass: drawing fresh samples for every input cost 1.4 s of gpt2-tiny's 2.2 s profile (normal_ writes
# ~1.3 GB/s on this CPU, a copy ~20 GB/s).  Values only need to be ordinary floats for timing.
_SAMPLE_ELEMENTS = 1 << 20
_samples: dict[torch.device, torch.Tensor] = {}


def _make_input(val: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=device)
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        return t.zero_()  # zeros are valid indices for embedding/gather/nll targets
    n_storage = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) if t.numel() else 0
    flat = t.as_strided((n_storage,), (1,))
    samples = _samples.get(device)
    if samples is None:
        samples = _samples[device] = torch.randn(_SAMPLE_ELEMENTS, device=device)
    for start in range(0, n_storage, _SAMPLE_ELEMENTS):
        chunk = flat[start : start + _SAMPLE_ELEMENTS]
        chunk.copy_(samples[: chunk.numel()])
    return t


# NOTE [group offsets]
#     A grouped matrix product (``aten._grouped_mm``; transformers' ``grouped_mm_fallback`` for mixture-of-experts
#     layers, and its backward) multiplies each group of rows by its own weight, the groups' ends given by an
#     integer tensor ``offs``.  The zeros generated for integer inputs made every group empty: the op did no work,
#     so a mixture-of-experts layer's expert products were timed at 0.4 ms where they take 1.7 ms (transformers'
#     op, 4 experts of 128 x 688 on 1,024 routed rows) and ``aten._grouped_mm`` 350x too fast, and the plan recomputed
#     them as if free (mixtral-tiny at half its peak: predicted 1.04x, measured 1.24x).  A generated ``offs`` (by
#     its schema name) now splits the grouped dimension evenly: the total work does not depend on how the router
#     splits the rows, only on how many there are.
_OFFSET_NAMES = ("offs", "offsets")


def _grouped_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """The dimension ``offs`` splits in ``_grouped_mm(a, b, offs)``: a's rows against stacked weights (2-D x 3-D),
    b's columns (3-D x 2-D), or the shared dimension (2-D x 2-D, a weight gradient)."""
    if a.dim() == 2 and b.dim() == 2:
        return int(a.shape[1])
    if a.dim() == 3 and b.dim() == 2:
        return int(b.shape[-1])
    return int(a.shape[0])


def _even_group_offsets(node: fx.Node, args: tuple, kwargs: dict, real: dict[str, torch.Tensor]) -> None:
    """Fill a generated ``offs`` argument with evenly split group ends (NOTE [group offsets])."""
    target = node.target
    if not isinstance(target, OpOverload) or len(args) < 2:
        return
    a, b = args[0], args[1]
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() in (2, 3) and b.dim() in (2, 3)):
        return  # not a grouped product of matrices (``embedding_bag``'s offsets index its 1-D indices)
    for i, arg in enumerate(target._schema.arguments):
        if arg.name not in _OFFSET_NAMES:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        source = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
        if (not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype.is_floating_point
                or value.dtype == torch.bool or (isinstance(source, fx.Node) and source.name in real)):
            continue
        groups, length = value.numel(), _grouped_length(a, b)
        ends = torch.arange(1, groups + 1, dtype=torch.int64) * length // max(groups, 1)
        value.copy_(ends.to(value.device, value.dtype))


def _writes_inputs(target) -> bool:
    """True if the op may write into one of its arguments (then it never gets the real tensors)."""
    if not isinstance(target, OpOverload):
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments)


def _real_view(a: fx.Node, real: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The step's tensor behind ``a``: a placeholder's own, or a view of one (``t``, ``view``, ``expand``),
    re-derived from it without allocating; None for anything else."""
    if a.name in real:
        return real[a.name]
    if a.op != "call_function" or not is_view_target(a.target):
        return None
    missing = False

    def resolve(n: fx.Node):
        nonlocal missing
        t = _real_view(n, real)
        missing = missing or t is None
        return t

    args, kwargs = fx.node.map_arg((a.args, a.kwargs), resolve)
    return None if missing else cast(Callable, a.target)(*args, **kwargs)


def _run_once(node: fx.Node, device: torch.device, real: dict[str, torch.Tensor]):
    """The op's target and arguments: the step's tensors (``real``, by placeholder name, and views of them)
    where the op only reads them, generated ones elsewhere."""
    use_real = bool(real) and not _writes_inputs(node.target)

    def materialize(a):
        if use_real:
            t = _real_view(a, real)
            if t is not None:
                return t
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return _make_input(v, _input_device(a, v, device, real))
        return v

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), materialize)
    _even_group_offsets(node, args, kwargs, real)
    return node.target, args, kwargs


# (producer op, output index, step device type) -> the device its kernel really returns that output on.
_output_devices: dict[tuple[str, int, str], torch.device] = {}


def _input_device(a: fx.Node, val: torch.Tensor, device: torch.device, real: dict[str, torch.Tensor]) -> torch.device:
    """Where the step's kernels put ``a``, for a generated copy of it.

    The trace can say otherwise: the fused attention kernels return their dropout's philox seed and offset
    as host tensors, which the fake trace places on the GPU with everything else, and their backward reads
    them on the host (given a device pointer there, the process crashed on an H100).  So an integer output
    of a multi-output op is placed where its producer, run once on generated inputs, really returns it
    (once per op and output in a process); a CPU value stays on the CPU.
    """
    if val.device.type == "cpu" or device.type == "cpu":
        return torch.device("cpu")
    if val.dtype.is_floating_point or val.dtype.is_complex or val.dtype == torch.bool:
        return device
    if a.target is not operator.getitem or not isinstance(a.args[0], fx.Node):
        return device
    producer, index = a.args[0], a.args[1]
    if not isinstance(producer.target, OpOverload) or not isinstance(index, int):
        return device
    key = (str(producer.target), index, device.type)
    if key not in _output_devices:
        found = device
        try:
            target, args, kwargs = _run_once(producer, device, real)
            with torch.no_grad():
                out = target(*args, **kwargs)
            if isinstance(out, (tuple, list)) and isinstance(out[index], torch.Tensor):
                found = out[index].device
        except Exception as exc:  # noqa: BLE001 -- the producer rejects generated inputs: keep the traced device
            log.debug("profile: %s failed on generated inputs (%s); output %d kept on %s", producer.target, exc,
                      index, device)
        _output_devices[key] = found
    return _output_devices[key]


def _time_op(node: fx.Node, device: torch.device, real: dict[str, torch.Tensor], min_total_ms: float = 2.0,
             max_reps: int = 20, warm: bool = False) -> float:
    """Median time (ms) of the op alone.  ``warm``: the op already ran at these sizes (NOTE [one warm-up])."""
    target, args, kwargs = _run_once(node, device, real)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        if not warm:
            target(*args, **kwargs)  # warm-up
            sync()
        times: list[float] = []
        total = 0.0
        while len(times) < 3 or (total < min_total_ms and len(times) < max_reps):
            t0 = time.perf_counter()
            target(*args, **kwargs)
            sync()
            dt = (time.perf_counter() - t0) * 1e3
            times.append(dt)
            total += dt
    times.sort()
    return times[len(times) // 2]


def _temp_bytes(nodes: list[fx.Node], device: torch.device, real: dict[str, torch.Tensor]) -> list[int]:
    """Temporary bytes of each op, from one profiled run of each (NOTE [temporary memory]).

    Each run sits inside a ``record_function`` range; within it the allocator's running total
    rises to a peak and ends at what the op returned, so the difference is its scratch.
    """
    if profiler_active():
        # Profiler sessions do not nest (a second one corrupts the first): under the caller's profiler, or
        # one of our meters, scratch cannot be read.  Said once per capture, never silently assumed.
        log.warning("remat_plugin.capture: a torch.profiler session is recording, so the kernel scratch of %d op(s) "
                    "cannot be measured and counts as 0 in this plan (it may then exceed its budget by one op's "
                    "scratch); plan outside the profiler to include it", len(nodes))
        return [0] * len(nodes)
    labels = [f"remat_plugin.profile.{i}" for i in range(len(nodes))]
    with memory_profile(cuda=device.type == "cuda") as prof:
        for node, label in zip(nodes, labels):
            try:
                target, args, kwargs = _run_once(node, device, real)
                with torch.no_grad(), record_function(label):
                    out = target(*args, **kwargs)
                del out, args, kwargs
            except Exception as exc:  # noqa: BLE001 -- failed on generated inputs: its time is estimated, no scratch
                log.debug("profile: %s failed on generated inputs (%s); no temporary bytes measured", node.target, exc)
    trace = allocator_trace(prof, device)
    temps = []
    for label in labels:
        if label not in trace.ranges:
            temps.append(0)
            continue
        peak, end = trace.peak_rise(*trace.ranges[label])
        scratch = peak - end
        temps.append(scratch if scratch >= MIN_TEMP_BYTES else 0)
    return temps


class OpTimings:
    """Measured op times and temporary bytes by :func:`op_signature`, kept by whoever plans repeatedly
    (bounded, oldest out).

    Measurements outlive one capture: re-planning the same shapes (another budget, a resumed
    run) then finds the same costs, hence the same problem and the same prepared planner.  Each
    is also kept by its place in the graph, for the same graph traced at other shapes (NOTE [op
    times across shapes]).
    """

    def __init__(self, max_entries: int = 100_000):
        self.max_entries = max_entries
        self._ms: OrderedDict[tuple, tuple[float, int]] = OrderedDict()
        self._by_place: OrderedDict[tuple[str, str], tuple[fx.Node, float, int]] = OrderedDict()
        # Costs carried to these sizes from another shape (NOTE [op times across shapes]), by op signature: another
        # graph of the same shapes (a re-plan for the outputs the caller drops) takes the same numbers, not another
        # carry from another measurement, so its plan and the first are judged alike.
        self._carried: OrderedDict[tuple, tuple[float, int]] = OrderedDict()
        # Entries of either table whose scratch was not read at their sizes (NOTE [scratch read later]).
        self._scratch_unread: set[tuple] = set()

    def get(self, sig: tuple) -> tuple[float, int] | None:
        """``(time_ms, temp_bytes)`` measured for ``sig``, or None."""
        return self._ms.get(sig)

    def put(self, sig: tuple, ms: float, temp_bytes: int, scratch_read: bool = True) -> None:
        self._bounded(self._ms, sig, (ms, temp_bytes))
        self._mark(sig, scratch_read)

    def carried(self, sig: tuple) -> tuple[float, int] | None:
        """``(time_ms, temp_bytes)`` carried to ``sig``'s sizes by an earlier capture, or None."""
        return self._carried.get(sig)

    def put_carried(self, sig: tuple, ms: float, temp_bytes: int, scratch_read: bool = True) -> None:
        self._bounded(self._carried, sig, (ms, temp_bytes))
        self._mark(sig, scratch_read)

    def scratch_unread(self, sig: tuple) -> bool:
        """True where ``sig``'s kept scratch was not read at its sizes: to be read by the next capture that can."""
        return sig in self._scratch_unread

    def any_scratch_unread(self) -> bool:
        """Whether any kept entry awaits its scratch: captures skip looking when none does (most processes)."""
        return bool(self._scratch_unread)

    def _mark(self, sig: tuple, scratch_read: bool) -> None:
        if scratch_read:
            self._scratch_unread.discard(sig)
        else:
            self._scratch_unread.add(sig)

    def _bounded(self, table: OrderedDict, key: tuple, value: tuple) -> None:
        """Add ``key`` to ``table``; the oldest entries go beyond ``max_entries``."""
        table[key] = value
        while len(table) > self.max_entries:
            gone, _ = table.popitem(last=False)
            if gone not in self._ms and gone not in self._carried:
                self._scratch_unread.discard(gone)

    def measured_in_graph(self, graph: str, node: fx.Node) -> tuple[fx.Node, float, int] | None:
        """The node at ``node``'s place in graph ``graph`` (a :attr:`JointGraph.structure_key`) when it was
        measured, with its ``(time_ms, temp_bytes)``; or None."""
        return self._by_place.get((graph, node.name))

    def put_in_graph(self, graph: str, node: fx.Node, ms: float, temp_bytes: int) -> None:
        self._bounded(self._by_place, (graph, node.name), (node, ms, temp_bytes))

    def __len__(self) -> int:
        return len(self._ms)


def profile_ops(joint: JointGraph, device: torch.device, progress=None, timings: OpTimings | None = None,
                real: dict[str, torch.Tensor] | None = None) -> OpCosts:
    """Measure each op of ``joint`` (looked up in ``timings`` first); failures fall back to a bytes-based estimate.

    ``real``: the step's tensors by placeholder name (parameters, buffers, inputs), read by ops
    that do not write their inputs instead of generated copies.
    """
    with _on_real_tensors(device):
        return _profile_ops(joint, device, progress, OpTimings() if timings is None else timings, real or {})


@contextlib.contextmanager
def _on_real_tensors(device: torch.device) -> Iterator[None]:
    """Inside, ops run on real tensors and leave the user's RNG stream where it was; generated inputs go after."""
    devices = [device] if device.type == "cuda" else []
    # Planning runs inside AOTAutograd's partitioner, under its fake-tensor mode: step out of it
    # so the ops run on real tensors.  Random ops must not shift the user's RNG stream.
    with unset_fake_temporarily(), torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            _samples.clear()


def scratch_of(joint: JointGraph, planned: dict[str, int], device: torch.device) -> dict[str, int]:
    """The temporary bytes (NOTE [temporary memory]) at ``joint``'s sizes of the ops ``planned`` names, which had
    that much scratch when a plan was made.

    For a plan replayed on other shapes or strides: only those ops are run again, so the simulator's check sees the
    scratch of these sizes (an op that had none is taken to have none, as in NOTE [op times across shapes]).  While
    a profiler records (our meter runs a rank's first replayed step before its caller does), scratch cannot be
    read: the planned bytes stand, which are exact where the shapes are the plan's (every rank replaying rank 0's).
    """
    nodes = [n for n in joint.ops if n.name in planned]
    if not nodes or device.type == "meta":
        return {}
    if profiler_active():
        return {n.name: planned[n.name] for n in nodes}
    with _on_real_tensors(device):
        return {n.name: b for n, b in zip(nodes, _temp_bytes(nodes, device, joint.real_inputs)) if b}


def _profile_ops(joint: JointGraph, device: torch.device, progress, timings: OpTimings,
                 real: dict[str, torch.Tensor]) -> OpCosts:
    measured: dict[tuple, tuple[float, int]] = {}
    new: dict[tuple, fx.Node] = {}  # timed here
    carried: dict[tuple, fx.Node] = {}  # scaled from the same graph at another shape (NOTE [op times across shapes])
    carried_before: set[tuple] = set()  # carried to these sizes by an earlier capture: taken as they were
    carried_unread: set[tuple] = set()  # carried from a measurement whose scratch was not read
    unread_kept = timings.any_scratch_unread()  # else no entry needs its signature looked up again
    graph = joint.structure_key
    sigs = [op_signature(node) for node in joint.ops]
    for node, sig in zip(joint.ops, sigs):
        found = measured.get(sig) or timings.get(sig)
        if found is None and (found := timings.carried(sig)) is not None:
            carried_before.add(sig)
        if found is None and sig not in new:
            before = timings.measured_in_graph(graph, node)
            if before is not None:
                found = (before[1] * _work_ratio(before[0], node), before[2])
                carried[sig] = node
                if unread_kept and timings.scratch_unread(op_signature(before[0])):  # none read there: read it here
                    carried_unread.add(sig)
            else:
                new[sig] = node
        if found is not None:
            measured[sig] = found
    # Under a profiler scratch cannot be read (_temp_bytes): a carried op keeps the scratch of the shape measured
    reading = not profiler_active()
    warm = reading  # then every new op ran once, profiled, before it is timed
    rescratch = [sig for sig in carried if measured[sig][1] > 0 or sig in carried_unread] if reading else []
    # scratch taken under a profiler before: read now (NOTE [scratch read later])
    stale = [sig for sig in dict.fromkeys(sigs) if sig not in new and sig not in carried
             and timings.scratch_unread(sig)] if reading and unread_kept else []
    with_scratch = [*new, *rescratch, *stale]
    scratch: dict[tuple, int] = {}
    if with_scratch:
        nodes = {**dict(zip(sigs, joint.ops)), **new, **carried}
        scratch = dict(zip(with_scratch, _temp_bytes([nodes[s] for s in with_scratch], device, real)))
    for i, (sig, node) in enumerate(new.items()):
        measured[sig] = (_measured_ms(joint, node, device, real, warm), 0)
        if progress is not None:
            progress(i + 1, len(new))
    for sig, b in scratch.items():
        measured[sig] = (measured[sig][0], b)
    for sig in new:
        timings.put(sig, *measured[sig], scratch_read=reading)
    for sig in carried:
        timings.put_carried(sig, *measured[sig],
                            scratch_read=reading or (measured[sig][1] == 0 and sig not in carried_unread))
    for sig in stale:
        (timings.put_carried if sig in carried_before else timings.put)(sig, *measured[sig])
    time_ms: dict[str, float] = {}
    temp: dict[str, int] = {}
    for node, sig in zip(joint.ops, sigs):
        time_ms[node.name], temp[node.name] = measured[sig]
        if sig not in carried and sig not in carried_before:  # only measurements are carried on, never carries
            timings.put_in_graph(graph, node, *measured[sig])
    if carried:
        log.debug("profile: %d of %d distinct ops timed, %d carried from another shape of this graph",
                  len(new), len(new) + len(carried), len(carried))
    return OpCosts(time_ms, temp)


def _measured_ms(joint: JointGraph, node: fx.Node, device: torch.device, real: dict[str, torch.Tensor],
                 warm: bool = False) -> float:
    try:
        return _time_op(node, device, real, warm=warm)
    except Exception as exc:  # noqa: BLE001 -- any op may reject random inputs: estimate from bytes moved
        est = sum(joint.value_bytes(v) for v in joint.values_of[node.name]) / 2e9 * 1e3
        log.debug("profile: %s failed on generated inputs (%s); estimated %.3f ms", node.target, exc, est)
        return est


def _work_ratio(before: fx.Node, now: fx.Node) -> float:
    """How much more work ``now`` does than ``before``, the same op at other sizes (1 where neither does any)."""
    was = work_ms(before)
    return work_ms(now) / was if was > 0 else 1.0
