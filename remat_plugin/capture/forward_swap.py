"""Putting a function in place of a module's ``forward`` and taking it out again, exactly.

An instance attribute ``forward`` shadows the class's method; restoring means putting back the
instance attribute that was there before, or removing ours so the class's method shows again.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

from torch import nn

_MISSING = object()


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


@contextlib.contextmanager
def swapped_forwards(modules: Sequence[nn.Module], make: Callable[[nn.Module, Callable], Callable]) -> Iterator[None]:
    """Inside the block each module's forward is ``make(module, its forward)``; all are restored on exit."""
    swaps: list[ForwardSwap] = []
    try:
        for m in modules:
            swaps.append(ForwardSwap(m, functools.partial(make, m)))
        yield
    finally:
        for swap in reversed(swaps):
            swap.restore()
