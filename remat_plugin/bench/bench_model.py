"""The :class:`BenchModel` record every benchmark factory returns, and the seeding helpers they share."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Batch = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass
class BenchModel:
    """A model plus everything a benchmark needs to run one training step of it."""

    name: str
    module: nn.Module  # in train mode; dropout active
    make_batch: Callable[[int], Batch]  # seed -> (args, kwargs) for module(*args, **kwargs)
    loss: Callable[[Any], torch.Tensor]  # module output -> scalar loss to call backward on
    # Repeated layers, in call order; each maps the previous one's hidden tensor to the next (models docstring).
    layers: list[nn.Module]
    # Per-layer checkpointing through the model's own switch (HF gradient_checkpointing_enable) when it has one.
    hf_gradient_checkpointing: bool = False
    meta: dict[str, Any] = field(default_factory=dict)  # sizes, for reports
    # False when the layers do not form one chain (an encoder-decoder, a U-Net): only per-layer segments apply.
    layers_chain: bool = True

    def step(self, batch: Batch) -> torch.Tensor:
        """Forward of the unmodified module on ``batch``; returns the loss."""
        args, kwargs = batch
        return self.loss(self.module(*args, **kwargs))


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Build under ``seed`` without moving the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
