"""Tensors that require grad but reach the forward from outside the module's parameters and the call's arguments.

NOTE [graded constants]
    ``torch.export`` lifts every tensor the forward reads that is not a parameter, a buffer or an argument into
    a constant of the program, detached: a plain attribute (``self.prompt = torch.randn(..., requires_grad=True)``,
    a soft prompt not wrapped in ``nn.Parameter``), a module kept in a plain list (``self.extra = [nn.Linear(...)]``,
    whose parameters the model does not register), or a tensor or module from outside the model (a global or a
    closure: a learnable temperature the optimizer also holds, a layer shared with another model), or a tensor
    computed outside the step and handed over in an attribute (``model.context = encoder(x)``).  The planned
    step gave those no gradient while eager PyTorch gives them one: the optimizer silently stopped training them
    (found 2026-11-28).  While the model is exported, a function mode records every real tensor that requires
    grad and is not one of the module's parameters or the call's tensors (the forward's own are fake there): a
    leaf, or a tensor computed outside that the model holds in an attribute (a framework's hook may hand the
    forward another alias of an argument: FSDP2's post-backward registration).  Any such capture is refused, naming
    each tensor and the fix (an ``nn.Parameter`` or submodule of the model, or an argument of the call).  A model
    with repeated layers falls back to per-layer checkpointing, whose forward runs as written and gives those
    tensors their gradients.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import CodeType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from remat_plugin.errors import CaptureError
from remat_plugin.torch_private import FakeTensor, pytree


class GradedTensors(TorchFunctionMode):
    """Records the real tensors that require grad passed to torch functions while active (export's fake tensors
    are not)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for a in pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.requires_grad and not isinstance(a, FakeTensor):
                self.seen.setdefault(id(a), a)
        return func(*args, **kwargs)

    def check(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Raise :class:`CaptureError` if a tensor seen is none of ``module``'s parameters or the call's tensors."""
        own = {id(t) for t in (*module.parameters(), *module.buffers(), *pytree.tree_leaves((args, kwargs)))}
        foreign = [t for key, t in self.seen.items() if key not in own]
        names = _names(module) if foreign else {}
        # A tensor computed outside (not a leaf) counts where the model holds it: a framework's hook may hand the
        # forward another alias of an argument (FSDP2's post-backward registration)
        foreign = [t for t in foreign if t.is_leaf or id(t) in names]
        if not foreign:
            return
        said = list(dict.fromkeys(names.get(id(t), "a tensor from outside the model (a closure?)") for t in foreign))
        which = "which requires grad but is not a parameter" if len(said) == 1 else \
            "which require grad but are not parameters"
        raise CaptureError(
            f"remat_plugin.capture: {type(module).__name__}'s forward reads {', '.join(said)}, {which} of the model: "
            "a traced graph holds such a tensor as a constant and gives it no gradient. Make it an nn.Parameter or a "
            "submodule of the model (self.prompt = nn.Parameter(...); a module in an nn.ModuleList, not a Python "
            "list), or pass it as an argument of the call")


def passing_on(code: CodeType) -> bool:
    """``code`` is one of the capture's function modes passing on a call it recorded (this one, and
    :class:`remat_plugin.capture.assigned_tensors.CallDerived`): its frame is none of the model's lines."""
    return code.co_name == "__torch_function__" and os.path.dirname(code.co_filename) == _CAPTURE_DIR


_CAPTURE_DIR = os.path.dirname(__file__)


def _names(module: nn.Module) -> dict[int, str]:
    """How to name the tensors the model reaches without registering them: by attribute path from the model, else
    as a global of a file defining one of its modules."""
    found: dict[int, str] = {}
    for path, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if not attr.startswith("_"):
                for inner, tensor in tensors_held(value, f"{path}.{attr}" if path else attr):
                    found.setdefault(id(tensor), f"{inner!r} (not registered with the model)")
    for sub in module.modules():
        for name, value in vars(sys.modules.get(type(sub).__module__, sys)).items():
            for inner, tensor in tensors_held(value, name):
                found.setdefault(id(tensor), f"the global {inner!r} of {type(sub).__module__}")
    return found


def tensors_held(value: Any, name: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors ``value`` holds (itself, a module's parameters, a list's or dict's items, two levels deep, 64
    items each), named from ``name``."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, nn.Module):
        for pname, p in value.named_parameters():
            yield f"{name}.{pname}", p
    elif isinstance(value, (list, tuple)) and depth < 2:
        for i, item in enumerate(value[:64]):
            yield from tensors_held(item, f"{name}[{i}]", depth + 1)
    elif isinstance(value, dict) and depth < 2:
        for key, item in list(value.items())[:64]:
            yield from tensors_held(item, f"{name}[{key!r}]", depth + 1)
