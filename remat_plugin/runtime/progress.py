"""Planning progress: which stage (capture, profile, solve) and how far, so a 15 s first step is not a hang.

When stderr is a terminal and ``rich`` is installed it is a transient progress bar on rank 0's
stderr, shown once planning has taken more than a second; without ``rich`` there is no bar.  Stage
lines go to the ``remat_plugin.progress`` logger at DEBUG, so a log file gets only the summary
line of :mod:`remat_plugin.runtime.reporting`, not one line per stage.  A level above INFO set
on ``remat_plugin.progress`` or ``remat_plugin`` (``remat plan --quiet``) turns the bar off;
``verbose=False`` does not create a progress at all.
"""
from __future__ import annotations

import logging
import sys
import time
from types import TracebackType
from typing import Any

from typing_extensions import Self

from remat_plugin.runtime import dist

log = logging.getLogger("remat_plugin.progress")


def _quieted(logger: logging.Logger) -> bool:
    """A level above INFO set on ``logger`` or a parent below the root (the root's WARNING default does not count)."""
    current: logging.Logger | None = logger
    while current is not None and current is not logging.getLogger():
        if current.level != logging.NOTSET:
            return current.level > logging.INFO
        current = current.parent
    return False


class PlanningProgress:
    """Context manager; call ``stage(name)``, then the instance itself as ``progress(done, total)``.

    Stages named before it is entered are only recorded: a planned step may capture its graph
    before the call that plans runs, and the bar belongs to that call.  ``elapsed_s`` counts
    from construction.
    """

    def __init__(self, title: str) -> None:
        self.title = title
        self._bar: Any = None
        self._task: Any = None
        self._stage = ""
        self._t0 = time.perf_counter()
        self._use_bar = False

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self._t0

    def __enter__(self) -> Self:
        self._use_bar = sys.stderr.isatty() and dist.is_rank_zero() and not _quieted(log)
        return self

    def _show_bar(self) -> bool:
        """Start the bar once a second has passed (quick plans print nothing)."""
        if self._bar is None and self._use_bar and self.elapsed_s > 1.0:
            try:
                from rich.console import Console
                from rich.progress import Progress
            except ImportError:
                self._use_bar = False
                return False
            self._bar = Progress(transient=True, console=Console(stderr=True))
            self._bar.start()
            self._task = self._bar.add_task(f"{self.title}: {self._stage}", total=None)
        return self._bar is not None

    def stage(self, name: str) -> None:
        self._stage = name
        log.debug("remat_plugin: %s: %s (%.1f s)", self.title, name, self.elapsed_s)
        if self._show_bar():
            self._bar.update(self._task, description=f"{self.title}: {name}", completed=0, total=None)

    def __call__(self, done: int, total: int) -> None:
        if self._show_bar():
            self._bar.update(self._task, completed=done, total=total)

    def close(self) -> None:
        """Take the bar off the terminal (before a line is printed under it); later updates show nothing."""
        if self._bar is not None:
            self._bar.stop()
        self._bar = None
        self._use_bar = False

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
        if exc is None:
            log.debug("remat_plugin: %s: done in %.1f s", self.title, self.elapsed_s)
