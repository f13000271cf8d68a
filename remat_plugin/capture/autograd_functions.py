"""A model's own ``torch.autograd.Function``s keep their backward through capture.

NOTE [autograd Functions]
    ``torch.export`` (non-strict, as we call it) records the ops a custom ``torch.autograd.Function``'s
    forward issues, and nothing of the Function itself.  The step's backward was then the derivative
    of those ops, not the Function's own backward: a straight-through estimator (rounding forward,
    identity backward) got a zero gradient, a gradient reversal layer the wrong sign, Bloom's GELU
    (transformers' ``GeLUFunction``) another rounding, all silently.  While a model is exported
    (:func:`opaque_functions`), each Function applied with grad mode on to a tensor that requires grad
    is one op, ``remat_plugin::autograd_function``, whose fake kernel runs the Function's forward for its
    outputs' sizes.  Once exported, every such node calls the Function itself (:func:`restore_functions`),
    so AOTAutograd's trace runs its forward and, through autograd, its backward: the joint graph holds
    both as the ops they issue, and planning goes on from that graph as from any other.  A Function
    whose forward or backward cannot be traced (a Triton kernel, a Python number read from a tensor)
    fails the capture as any untraceable op does.  One that changes an input in place (``ctx.mark_dirty``)
    does so again when the restored node runs, in the exported graph's order, which is the model's.
    Functions applied with nothing to differentiate are left to export (no backward of theirs runs), and so
    are PyTorch's own.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx

from remat_plugin.errors import CaptureError
from remat_plugin.torch_private import autocast_as, autocast_settings, pytree

# PyTorch's own Functions (FSDP's hooks, DTensor's conversions) are export's to handle, as before; ours never run
# inside a model.
_LEFT_TO_EXPORT = ("torch.", "remat_plugin.")
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_TENSOR = object()  # stands for a tensor leaf among an application's constants


@dataclass
class _Application:
    """One kind of call of a Function: its class and its non-tensor arguments (tensors stand as ``_TENSOR``)."""

    function: type
    spec: Any  # pytree spec of (args, kwargs)
    constants: tuple
    # Autocast where it was applied: its forward runs under it wherever the node runs (AOTAutograd's trace, the
    # fake kernel), as it did in the model (``torch.amp.custom_fwd`` casts by it).
    autocast: tuple
    out_spec: Any = None  # the outputs' structure, once its forward has run on fake tensors
    out_constants: tuple = ()  # the outputs' non-tensor leaves, _TENSOR where a tensor goes

    def call(self, tensors: list[Tensor]) -> Any:
        it = iter(tensors)
        args, kwargs = pytree.tree_unflatten([next(it) if c is _TENSOR else c for c in self.constants], self.spec)
        with autocast_as(self.autocast):
            return _ORIGINAL_APPLY.__get__(None, self.function)(*args, **kwargs)

    def outputs(self, tensors: list[Tensor]) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if c is _TENSOR else c for c in self.out_constants], self.out_spec)


# By id, as the op names them.  Interned by (class, structure, constants), so that every layer applying one
# Function alike issues the same op (NOTE [layers traced once] fingerprints a layer by its ops).
_APPLICATIONS: dict[int, _Application] = {}
_IDS: dict[tuple, int] = {}
_ORIGINAL_APPLY = torch.autograd.Function.__dict__["apply"]


def _constant_key(c: Any) -> tuple:
    return ("value", type(c), repr(c)) if isinstance(c, _PLAIN) else ("object", id(c))  # the entry keeps it alive


def _application_id(function: type, spec: Any, constants: tuple) -> int:
    autocast = autocast_settings()
    key = (function, repr(spec), tuple(_constant_key(c) for c in constants), autocast)
    if key not in _IDS:
        _IDS[key] = len(_IDS)
        _APPLICATIONS[_IDS[key]] = _Application(function, spec, constants, autocast)
    return _IDS[key]


class _Exporting(threading.local):
    """How deep this thread is in an export (routes Functions to the op) and in the op's own run (does not)."""

    depth = 0
    running = 0


_exporting = _Exporting()
_patches = 0  # threads exporting: the class attribute is patched while any is
_patch_lock = threading.Lock()


@torch.library.custom_op("remat_plugin::autograd_function", mutates_args=())
def _function_op(application: int, inputs: list[Tensor]) -> list[Tensor]:
    raise CaptureError("remat_plugin.capture: an exported autograd.Function ran unrestored (NOTE [autograd "
                       "Functions]); report this with your torch version")


@_function_op.register_fake
def _function_fake(application, inputs):
    app = _APPLICATIONS[application]
    _exporting.running += 1
    try:
        with torch.no_grad():
            out = app.call(inputs)
    finally:
        _exporting.running -= 1
    leaves, out_spec = pytree.tree_flatten(out)
    out_constants = tuple(_TENSOR if isinstance(x, Tensor) else x for x in leaves)
    if app.out_spec is None:
        app.out_spec, app.out_constants = out_spec, out_constants
    elif (repr(app.out_spec), repr(app.out_constants)) != (repr(out_spec), repr(out_constants)):
        raise CaptureError(f"remat_plugin.capture: {app.function.__qualname__} (a torch.autograd.Function) returned "
                           "outputs of another structure for the same arguments; a captured graph cannot hold it")
    return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in leaves if isinstance(t, Tensor)]


def _never_differentiated(ctx, grads):
    raise CaptureError("remat_plugin.capture: an exported autograd.Function was differentiated unrestored (NOTE "
                       "[autograd Functions]); report this with your torch version")


_function_op.register_autograd(_never_differentiated)


def _routed_apply(cls, *args, **kwargs):
    apply = _ORIGINAL_APPLY.__get__(None, cls)
    if not _exporting.depth or _exporting.running or not torch.is_grad_enabled() or \
            cls.__module__.startswith(_LEFT_TO_EXPORT):
        return apply(*args, **kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, Tensor)]
    if not any(t.requires_grad for t in tensors):
        return apply(*args, **kwargs)  # nothing to differentiate: export's record of its ops is the whole step
    application = _application_id(cls, spec, tuple(_TENSOR if isinstance(x, Tensor) else x for x in leaves))
    outs = torch.ops.remat_plugin.autograd_function(application, tensors)
    return _APPLICATIONS[application].outputs(outs)


@contextlib.contextmanager
def opaque_functions() -> Iterator[None]:
    """Inside, on this thread, a Function applied to a tensor that requires grad is one opaque op (for
    ``torch.export``); :func:`restore_functions` makes the exported nodes call the Functions again."""
    global _patches
    with _patch_lock:
        if _patches == 0:
            torch.autograd.Function.apply = classmethod(_routed_apply)  # type: ignore[method-assign,assignment]
        _patches += 1
    _exporting.depth += 1
    try:
        yield
    finally:
        _exporting.depth -= 1
        with _patch_lock:
            _patches -= 1
            if _patches == 0:
                torch.autograd.Function.apply = _ORIGINAL_APPLY  # type: ignore[method-assign]


def apply_function(application: int, inputs: list[Tensor]) -> list[Tensor]:
    """What an exported ``remat_plugin::autograd_function`` node calls once restored: the Function itself, so
    autograd records its backward."""
    out = _APPLICATIONS[application].call(inputs)
    return [x for x in pytree.tree_leaves(out) if isinstance(x, Tensor)]


def restore_functions(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with every opaque Function op calling its Function (:func:`apply_function`)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.remat_plugin.autograd_function.default:
            node.target = apply_function
            changed = True
    if changed:
        gm.recompile()
    return gm
