"""Draws from Python's and NumPy's global generators while a model is exported.

NOTE [host random draws]
    A forward that draws from ``random`` or ``numpy.random`` (transformers' SpecAugment masks in
    Wav2Vec2 and SEW-D, a LayerDrop written with ``random.random()``) makes Python numbers and tensors
    built from them, which ``torch.export`` records as constants and branches taken: a captured graph
    would repeat that one draw at every step, silently (torch's own generator is different: its draws
    are ops of the graph, replayed per step).  Export also advanced the caller's generators, so the
    first real step drew other numbers than eager's.  :class:`HostDraws` restores both generators after
    the export, and :meth:`HostDraws.check` raises :class:`CaptureError` when the forward drew from either,
    naming the fix; the model then falls back to per-layer checkpointing, whose forward runs as written.
"""
from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

from remat_plugin.errors import CaptureError

try:
    import numpy as np
except ImportError:  # pragma: no cover -- torch works without numpy
    np = None  # type: ignore[assignment]


def _numpy_state() -> Any:
    return None if np is None else np.random.get_state()


def _same_numpy_state(a: Any, b: Any) -> bool:
    return a is None or (a[0] == b[0] and a[2:] == b[2:] and bool(np.array_equal(a[1], b[1])))


class HostDraws:
    """Whether a region drew from Python's or NumPy's global generator; both are restored after it."""

    def __init__(self) -> None:
        self.drawn: list[str] = []

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        python, numpy = random.getstate(), _numpy_state()
        try:
            yield
        finally:
            if random.getstate() != python:
                self.drawn.append("random")
                random.setstate(python)
            if not _same_numpy_state(numpy, _numpy_state()):
                self.drawn.append("numpy.random")
                np.random.set_state(numpy)

    def check(self, model: str) -> None:
        if self.drawn:
            raise CaptureError(
                f"remat_plugin.capture: {model}'s forward draws from {' and '.join(self.drawn)} while it runs; a "
                "captured graph would hold the numbers of one draw and repeat them at every step (a SpecAugment "
                "mask, a LayerDrop written with random.random()). Draw with torch's generator instead (torch.rand, "
                "torch.randint, torch.bernoulli), whose draws the plan replays per step")
