"""What one op must do, from its shapes alone: FLOPs and bytes moved, counted on meta tensors.

Two uses: op times where nothing can run (planning on ``meta``, :mod:`remat_plugin.capture.estimated_costs`),
and carrying a time measured at one shape to another (NOTE [op times across shapes] in
:mod:`remat_plugin.capture.measured_costs`).  FLOPs come from PyTorch's own formulas
(``torch.utils.flop_counter``); nothing is allocated.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceRates:
    flops_per_s: float = 100e12  # dense matmul throughput (bf16-class accelerator)
    bytes_per_s: float = 1.5e12  # memory bandwidth
    launch_ms: float = 0.005  # fixed cost per op


GPU_CLASS = DeviceRates()


def _meta_like(val: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")


def op_work(node: fx.Node) -> tuple[int, int]:
    """``(FLOPs, bytes read and written)`` of one call_function node, from its arguments' and outputs' meta."""
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
        log.debug("op_work: %s did not run on meta (%s); bytes only", node.target, exc)
    return flops, moved


def work_ms(node: fx.Node, rates: DeviceRates = GPU_CLASS) -> float:
    """The op's roofline time at ``rates`` (ms), without the launch cost: the slower of compute and memory."""
    flops, moved = op_work(node)
    return max(flops / rates.flops_per_s, moved / rates.bytes_per_s) * 1e3
