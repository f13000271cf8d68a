"""Planning progress: which stage (capture, profile, solve) and how far, so a 15 s first step is not a hang.

On a terminal with ``rich`` installed it is a progress bar, shown once planning has taken
more than a second; otherwise one INFO log line per stage.  Quiet when the ``remat_plugin.runtime.progress`` logger (or ``remat_plugin``) is set above INFO.
"""
from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any

from typing_extensions import Self

log = logging.getLogger("remat_plugin.progress")


class PlanningProgress:
    """Context manager; call ``stage(name)``, then the instance itself as ``progress(done, total)``."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._bar: Any = None
        self._task: Any = None
        self._stage = ""
        self._t0 = time.perf_counter()
        self._use_bar = False

    def __enter__(self) -> Self:
        self._use_bar = log.isEnabledFor(logging.INFO) and sys.stderr.isatty()
        self._t0 = time.perf_counter()
        return self

    def _show_bar(self) -> bool:
        """Start the bar once a second has passed (quick plans print nothing)."""
        if self._bar is None and self._use_bar and time.perf_counter() - self._t0 > 1.0:
            try:
                from rich.progress import Progress
            except ImportError:
                self._use_bar = False
                return False
            self._bar = Progress(transient=True)
            self._bar.start()
            self._task = self._bar.add_task(f"{self.title}: {self._stage}", total=None)
        return self._bar is not None

    def stage(self, name: str) -> None:
        self._stage = name
        if self._use_bar:
            if self._show_bar():
                self._bar.update(self._task, description=f"{self.title}: {name}", completed=0, total=None)
        elif log.isEnabledFor(logging.INFO):
            log.info("remat_plugin: %s: %s (%.1f s)", self.title, name, time.perf_counter() - self._t0)

    def __call__(self, done: int, total: int) -> None:
        if self._use_bar and self._show_bar():
            self._bar.update(self._task, completed=done, total=total)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif not self._use_bar and log.isEnabledFor(logging.INFO) and exc is None:
            log.info("remat_plugin: %s: done in %.1f s", self.title, time.perf_counter() - self._t0)
