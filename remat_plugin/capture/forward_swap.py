"""Putting a function in place of a module's ``forward`` and taking it out again, exactly.

An instance attribute ``forward`` shadows the class's method; restoring means putting back the
instance attribute that was there before, or removing ours so the class's method shows again.

NOTE [copies of a module we run]
    A function we put on a module refers to that module (and to a session planned for it).  A
    deep copy of the module (an EMA or averaged model) copies the module's attributes, and a
    plain function is copied as itself: the copy's forward was ours, which ran the *original*
    module's parameters, silently.  :class:`InstalledForward` copies (and pickles) as the forward
    that was there before ours, bound to the copy: a copy of a module we run is a plain copy
    (FSDP2 refuses deep copies of a sharded model itself).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

from torch import nn

_MISSING = object()


def _class_forward(module: nn.Module) -> Callable:
    return type(module).forward.__get__(module)


def _as_it_is(fn: Callable) -> Callable:
    return fn


class InstalledForward(functools.partial):
    """``fn``, put on ``module`` in place of ``previous`` (``None``: the class's forward); a deep copy or a pickle of
    it is ``previous`` for the copied module (NOTE [copies of a module we run]).  A ``functools.partial``, whose
    ``func`` ``torch.export`` reads a forward's code from."""

    module: nn.Module
    previous: Callable | None
    __wrapped__: Callable

    def __new__(cls, fn: Callable, module: nn.Module, previous: Callable | None):
        self = super().__new__(cls, fn)
        self.module = module
        self.previous = previous
        self.__wrapped__ = fn  # what inspect and Lightning's is_overridden read a forward's code and signature from
        return self

    def __reduce__(self):  # type: ignore[override]
        if self.previous is None:
            return _class_forward, (self.module,)
        return _as_it_is, (self.previous,)


class ForwardSwap:
    """Replaces ``module.forward`` with ``make(original_forward)``; :meth:`restore` puts back what was there."""

    def __init__(self, module: nn.Module, make: Callable[[Callable], Callable]):
        self.module = module
        self._previous = module.__dict__.get("forward", _MISSING)
        previous = None if self._previous is _MISSING else self._previous
        module.forward = InstalledForward(make(module.forward), module, previous)  # type: ignore[method-assign]

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
