"""Rank helpers: one place that asks ``torch.distributed`` who we are and exchanges small objects.

Without an initialized process group every helper answers as the only process, so the same
code runs in one process and under DDP.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def is_rank_zero() -> bool:
    return rank() == 0


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if world_size() == 1:
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_from_rank_zero(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself in one process)."""
    if world_size() == 1:
        return obj
    payload = [obj]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]
