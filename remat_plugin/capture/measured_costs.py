"""Per-op costs measured on the inputs' device, one op at a time with generated inputs.

Profiling never runs the whole unmodified step (the model may not fit): each op runs
alone on fresh tensors shaped like its real inputs, so the most it holds is one op's
inputs and outputs.  Ops with the same target, argument shapes and constants share one
measurement, which is how identical blocks are profiled once.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import fx

from remat_plugin.capture.joint import JointGraph
from remat_plugin.torch_private import unset_fake_temporarily

log = logging.getLogger(__name__)


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


def _make_input(val: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=device)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.normal_()
    else:
        t.zero_()  # zeros are valid indices for embedding/gather/nll targets
    return t


def _run_once(node: fx.Node, device: torch.device):
    def materialize(a):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            return _make_input(v, device)
        return v

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), materialize)
    return node.target, args, kwargs


def _time_op(node: fx.Node, device: torch.device, min_total_ms: float = 2.0, max_reps: int = 20) -> float:
    target, args, kwargs = _run_once(node, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
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


class OpTimings:
    """Measured op times by :func:`op_signature`, kept by whoever plans repeatedly (bounded, oldest out).

    Measurements outlive one capture: re-planning the same shapes (another budget, a resumed
    run) then finds the same costs, hence the same problem and the same prepared planner.
    """

    def __init__(self, max_entries: int = 100_000):
        self.max_entries = max_entries
        self._ms: OrderedDict[tuple, float] = OrderedDict()

    def get(self, sig: tuple) -> float | None:
        return self._ms.get(sig)

    def put(self, sig: tuple, ms: float) -> None:
        self._ms[sig] = ms
        while len(self._ms) > self.max_entries:
            self._ms.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ms)


def profile_ops(joint: JointGraph, device: torch.device, progress=None, timings: OpTimings | None = None) -> OpCosts:
    """Measure each op of ``joint`` (looked up in ``timings`` first); failures fall back to a bytes-based estimate."""
    devices = [device] if device.type == "cuda" else []
    # Planning runs inside AOTAutograd's partitioner, under its fake-tensor mode: step out of it
    # so the ops run on real tensors.  Random ops must not shift the user's RNG stream.
    with unset_fake_temporarily(), torch.random.fork_rng(devices=devices):
        return _profile_ops(joint, device, progress, OpTimings() if timings is None else timings)


def _profile_ops(joint: JointGraph, device: torch.device, progress, timings: OpTimings) -> OpCosts:
    time_ms: dict[str, float] = {}
    temp: dict[str, int] = {}
    for i, node in enumerate(joint.ops):
        sig = op_signature(node)
        ms = timings.get(sig)
        if ms is None:
            try:
                ms = _time_op(node, device)
            except Exception as exc:  # noqa: BLE001 -- any op may reject random inputs: estimate from bytes moved
                est = sum(joint.value_bytes(v) for v in joint.values_of[node.name]) / 2e9 * 1e3
                log.debug("profile: %s failed on generated inputs (%s); estimated %.3f ms", node.target, exc, est)
                ms = est
            timings.put(sig, ms)
        time_ms[node.name] = ms
        temp[node.name] = 0
        if progress is not None:
            progress(i + 1, len(joint.ops))
    return OpCosts(time_ms, temp)
