"""The function put in place of a module's ``forward``: training calls go to the plan, others to the original."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from remat_plugin.errors import RematError
from remat_plugin.runtime.unplanned_calls import is_planned_call, run_unplanned


class _Recorded(Exception):
    """Stops a probe at the module's call, carrying its arguments."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("recorded")
        self.args, self.kwargs = args, kwargs


@contextlib.contextmanager
def _calls_reach(module: nn.Module, real_forward: Callable) -> Iterator[None]:
    """Inside, ``module(...)`` calls ``real_forward`` directly, not what wraps ours in ``module.forward``.

    Capture and the fallback call the module again from inside a planned call.  Through ``module.forward`` that
    call would enter the wrappers around ours a second time, nested: Accelerate's mixed-precision forward is one
    ``torch.autocast`` object entered on every call, which remembers the state to restore on the object itself, so
    the nested entry made the outer exit leave autocast on for the rest of the process (every later op, the
    backward and the optimizer step included).  The autocast state the capture traces under is the one the outer
    wrappers set, and their output conversion applies to what the planned call returns.
    """
    had = "forward" in module.__dict__
    installed = module.__dict__.get("forward")
    module.__dict__["forward"] = real_forward
    try:
        yield
    finally:
        if had:
            module.__dict__["forward"] = installed
        else:
            del module.__dict__["forward"]


class Dispatcher:
    """Sends training calls with gradients of ``module`` to ``planned(args, kwargs)``.

    Every other call (eval, ``no_grad``, and the calls capture itself makes while a planned
    call is under way) runs the original forward.
    """

    def __init__(self, module: nn.Module, planned: Callable[[tuple, dict], Any]):
        self.module = module
        self.planned = planned
        self._busy = False
        self._recording = False

    def forward_for(self, real_forward: Callable) -> Callable:
        """The function to put in place of ``module.forward``; it calls ``real_forward`` where no plan applies."""

        def forward(*args, **kwargs):
            if self._busy:
                return real_forward(*args, **kwargs)
            if not is_planned_call(self.module):
                return run_unplanned(self.module, real_forward, args, kwargs)
            if self._recording:
                raise _Recorded(args, kwargs)
            self._busy = True  # capture and the fallback call the module again: those run the original
            try:
                with _calls_reach(self.module, real_forward):
                    return self.planned(args, kwargs)
            finally:
                self._busy = False

        forward.__wrapped__ = real_forward  # type: ignore[attr-defined]
        return forward

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Calls to the module run its original forward (for captures made outside the session)."""
        busy, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = busy

    def record_call(self, run: Callable[[], Any]) -> tuple[tuple, dict]:
        """The arguments of the first training call ``run()`` makes to the module; that call does not run."""
        self._recording = True
        try:
            run()
        except _Recorded as call:
            return call.args, call.kwargs
        finally:
            self._recording = False
        raise RematError(f"remat_plugin.session: the probe never called {type(self.module).__name__} in training "
                         "mode with gradients enabled")
