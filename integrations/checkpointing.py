"""Readying a model for a remat plan: HF cache and HF checkpointing off, ``CheckpointWrapper`` modules found."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from remat_plugin.runtime.dist import is_rank_zero
from remat_plugin.runtime.hf_cache import disable_hf_cache

log = logging.getLogger(__name__)


def _hf_checkpointing(m: nn.Module) -> bool:
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5 renamed it
        if hasattr(type(m), attr):
            return bool(getattr(m, attr))
    return False


def find_double_checkpointing(target: nn.Module) -> tuple[list[nn.Module], list[str]]:
    """HF models with gradient checkpointing on, and names of ``CheckpointWrapper`` modules, inside ``target``."""
    hf = [m for m in target.modules() if _hf_checkpointing(m)]
    wrapped = [name for name, m in target.named_modules() if type(m).__name__ == "CheckpointWrapper"]
    return hf, wrapped


def disable_hf_checkpointing(model: nn.Module) -> None:
    """Turn off a transformers model's own (per-layer) checkpointing: our plan decides what to recompute."""
    off = getattr(model, "activation_checkpointing_disable", None) or getattr(model, "gradient_checkpointing_disable", None)
    if off is not None:
        off()


def rank_zero_tellers(logger: logging.Logger) -> tuple[Callable[[str], None], Callable[[str], None]]:
    """:func:`settle_checkpointing`'s ``info`` and ``warn``: ``logger`` at INFO and WARNING, on rank 0 only."""
    def teller(level: int) -> Callable[[str], None]:
        return lambda message: logger.log(level, "%s", message) if is_rank_zero() else None
    return teller(logging.INFO), teller(logging.WARNING)


def settle_checkpointing(target: nn.Module, prefix: str, info: Callable[[str], Any],
                         warn: Callable[[str], Any]) -> list[str]:
    """Ready ``target`` for a remat plan, telling the user through ``info``/``warn``; returns what we cannot undo.

    The HF cache goes off (see :func:`disable_hf_cache`) and HF's own checkpointing goes off (the
    plan decides what to recompute).  ``CheckpointWrapper`` modules cannot be unwrapped: their
    names come back, and the caller stays off rather than checkpoint twice.
    """
    for name in disable_hf_cache(target):
        info(f"{prefix}: setting use_cache=False on {name} (a cache returned by a training forward keeps every "
             "layer's keys and values alive; transformers does the same under checkpointing)")
    hf, wrapped = find_double_checkpointing(target)
    for model in hf:
        warn(f"{prefix}: turning off gradient checkpointing of {type(model).__name__}; the remat plan decides what "
             "to recompute (gradients are unchanged)")
        disable_hf_checkpointing(model)
    return wrapped
