"""Op times without running on the target device: FLOPs and bytes moved, for planning on ``meta``.

Planning a model too large for this machine (``remat plan --device meta``) cannot time its
ops, so each op is estimated from what it must do: ``max(FLOPs / compute rate, bytes /
memory bandwidth) + launch overhead``.  FLOPs come from PyTorch's own formulas
(``torch.utils.flop_counter``), run on meta tensors, so nothing is allocated.  The rates
describe a GPU-class device; only ratios between ops matter to the plan's choices, and the
predicted step time is an estimate, not a measurement.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from remat_plugin.capture.joint import JointGraph
from remat_plugin.capture.measured_costs import OpCosts, op_signature
from remat_plugin.torch_private import unset_fake_temporarily

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceRates:
    flops_per_s: float = 100e12  # dense matmul throughput (bf16-class accelerator)
    bytes_per_s: float = 1.5e12  # memory bandwidth
    launch_ms: float = 0.005  # fixed cost per op


def _meta_like(val: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")


def _op_ms(node: fx.Node, rates: DeviceRates) -> float:
    moved = 0

    def materialize(a):
        nonlocal moved
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            moved += v.numel() * v.element_size()
            return _meta_like(v)
        return v

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), materialize)
    out = node.meta.get("val")
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(t, torch.Tensor):
            moved += t.numel() * t.element_size()
    flops = 0
    try:
        with FlopCounterMode(display=False) as counter:
            node.target(*args, **kwargs)  # type: ignore[operator]
        flops = counter.get_total_flops()
    except Exception as exc:  # noqa: BLE001 -- an op without a meta kernel costs its bytes only
        log.debug("cost_model: %s did not run on meta (%s); bytes only", node.target, exc)
    return max(flops / rates.flops_per_s, moved / rates.bytes_per_s) * 1e3 + rates.launch_ms


def estimate_costs(joint: JointGraph, rates: DeviceRates = DeviceRates(), progress=None) -> OpCosts:
    """Estimated ``OpCosts`` of every op of ``joint`` (no real tensor is allocated)."""
    cache: dict[tuple, float] = {}
    time_ms: dict[str, float] = {}
    with unset_fake_temporarily():
        for i, node in enumerate(joint.ops):
            sig = op_signature(node)
            if sig not in cache:
                cache[sig] = _op_ms(node, rates)
            time_ms[node.name] = cache[sig]
            if progress is not None:
                progress(i + 1, len(joint.ops))
    return OpCosts(time_ms, {n.name: 0 for n in joint.ops})
