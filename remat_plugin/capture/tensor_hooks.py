"""Gradient hooks a forward registers on its own tensors while it is exported.

NOTE [hooks in the forward]
    ``h.register_hook(fn)`` inside a forward (a gradient reversal layer, an activation's gradient clipped or
    scaled) changes the gradient autograd sends back through ``h``.  ``torch.export`` records no such hook: the
    traced step ran without it and computed other gradients, silently (a reversed layer's weights got the
    unreversed gradient).  ``h.retain_grad()`` is lost alike (``h.grad`` stays None).  While a model is exported,
    both are recorded where the model's own code calls them (torch's internal calls are its own business), and
    :meth:`ForwardHooks.check` raises :class:`CaptureError` naming the line and the fix: an autograd Function,
    whose backward the trace keeps (NOTE [autograd Functions]).  A model with repeated layers then falls back to
    per-layer checkpointing, whose forward runs as written, hooks included.  Hooks registered outside the forward
    (on a parameter, before training) are not the trace's concern: autograd runs them on the step's gradients.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from remat_plugin.capture.graded_constants import passing_on
from remat_plugin.errors import CaptureError

_TORCH_FILES = ("site-packages/torch/", "/torch/_")  # torch's own calls, installed or from a source tree


class ForwardHooks:
    """The gradient hooks and ``retain_grad`` calls a region's Python code (not torch's) made on tensors."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        originals = {name: getattr(torch.Tensor, name) for name in ("register_hook", "retain_grad")}

        def recording(name: str, original: Callable) -> Callable:
            def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                caller = sys._getframe(1)
                where = caller.f_code.co_filename
                # a call through one of the capture's function modes is that mode passing on a call already recorded
                if not any(part in where for part in _TORCH_FILES) and not passing_on(caller.f_code):
                    self.calls.append(f"{name}() at {where}:{caller.f_lineno}")
                return original(tensor, *args, **kwargs)

            return method

        try:
            for name, original in originals.items():
                setattr(torch.Tensor, name, recording(name, original))
            yield
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    def check(self, model: str) -> None:
        if self.calls:
            raise CaptureError(
                f"remat_plugin.capture: {model}'s forward calls {self.calls[0]}"
                f"{f' (and {len(self.calls) - 1} more)' if len(self.calls) > 1 else ''}; a traced graph holds no "
                "hook on its own tensors, so the step would compute other gradients. Write the hook as a "
                "torch.autograd.Function whose backward does what the hook does (a gradient reversal layer: "
                "forward returns x.view_as(x), backward returns -scale * grad), which the trace keeps")
