"""Module-level fallback for models torch.export cannot capture.

When the whole model has no graph (data-dependent control flow, an unsupported op), we
still know its structure: its lists of repeated layers (a ``ModuleList`` or ``Sequential`` of one
class; a vision tower's beside a language model's) are the chains.  Each layer then runs under non-reentrant
``torch.utils.checkpoint``, which keeps only layer inputs and recomputes the rest in
backward (random ops replay their generator state).  Buffers a layer updates in its
forward (BatchNorm running statistics) are restored after the recomputation, so they
change exactly once per step.  Without a graph there is no memory model: the plan says
so, and the budget is not verified.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat_plugin.capture.forward_swap import swapped_forwards
from remat_plugin.ir.plan import BlockChoice, Plan
from remat_plugin.runtime.side_effects import restored_buffers
from remat_plugin.torch_private import in_backward

log = logging.getLogger(__name__)


def _checkpointed_forward(layer: nn.Module, forward):
    def run(*args, **kwargs):
        if not in_backward():  # the forward pass: buffers update as usual
            return forward(*args, **kwargs)
        with restored_buffers(layer):  # a recomputation inside backward must not update buffers again
            return forward(*args, **kwargs)

    def checkpointed(*args, **kwargs):
        if not (torch.is_grad_enabled() and layer.training):
            return forward(*args, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    return checkpointed


def checkpointed_layers(layers: list[nn.Module]) -> contextlib.AbstractContextManager[None]:
    """Run ``layers`` checkpointed inside the block; their ``forward`` is restored on exit."""
    return swapped_forwards(layers, _checkpointed_forward)


def fallback_plan(reason: str, chains: list[tuple[str, list[nn.Module]]], budget_bytes: int, signature: str) -> Plan:
    """A plan that records the fallback; memory figures are unknown (-1) without a graph."""
    names = " and ".join(repr(name) for name, _ in chains)
    n_layers = sum(len(layers) for _, layers in chains)
    log.warning(
        "remat_plugin: %s; falling back to checkpointing each of the %d layers of %s. "
        "Without a graph the budget of %d bytes cannot be verified.", reason, n_layers, names, budget_bytes,
    )
    return Plan(
        budget_bytes=budget_bytes, margin_bytes=0, predicted_peak_bytes=-1, predicted_time_ms=-1.0,
        baseline_peak_bytes=-1, baseline_time_ms=-1.0, min_feasible_bytes=-1,
        blocks=tuple(BlockChoice(i, 0, "checkpoint", -1, -1.0) for i in range(n_layers)),
        n_unique_blocks=1, signature=signature,
        fallback=f"{reason}; per-layer checkpointing of {names} ({n_layers} layers)",
    )
