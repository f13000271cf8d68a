"""Putting a session's dispatcher in place of a module's forward, and taking it out again, exactly."""
from __future__ import annotations

import logging
from collections.abc import Callable

from torch import nn

log = logging.getLogger(__name__)

_MISSING = object()


def find_double_checkpointing(target: nn.Module) -> tuple[list[nn.Module], list[str]]:
    """HF models with gradient checkpointing on, and names of ``CheckpointWrapper`` modules, inside ``target``."""
    hf = [m for m in target.modules() if getattr(m, "is_gradient_checkpointing", False)]
    wrapped = [name for name, m in target.named_modules() if type(m).__name__ == "CheckpointWrapper"]
    return hf, wrapped


class ForwardSwap:
    """Replaces ``module.forward`` with ``make(original_forward)``; :meth:`restore` puts back what was there."""

    def __init__(self, module: nn.Module, make: Callable[[Callable], Callable]):
        self.module = module
        self._previous = module.__dict__.get("forward", _MISSING)
        module.forward = make(module.forward)  # type: ignore[method-assign]

    def restore(self) -> None:
        if self._previous is _MISSING:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self._previous  # type: ignore[method-assign]
