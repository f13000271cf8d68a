"""Capture features a benchmark turns off, to measure each against what the package did before it."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator


class CaptureSwitch:
    """On, except for the steps captured inside :meth:`off` (a benchmark's baseline)."""

    def __init__(self) -> None:
        self.on = True

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
