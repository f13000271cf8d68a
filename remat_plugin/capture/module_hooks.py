"""Hooks on the model's modules, which a planned step does not run the way eager PyTorch does.

NOTE [module hooks]
    A planned step runs programs made from the traced graph, not the modules.  Forward hooks and
    pre-hooks run while the graph is traced: the tensor ops they compute are in the graph and run at
    every step (the reparametrised weight of ``spectral_norm``, a pruning mask, transformers'
    ``enable_input_require_grads``), but their Python side effects (a tensor stored in a dict, a
    logged statistic, a call counter) happen once, on traced values.  So a capture says once per model
    which forward hooks it traced, unless they are PyTorch's own (``torch.*``: parametrisations, FSDP,
    module trackers), ours, or transformers' (``enable_input_require_grads``, and the hooks collecting
    ``output_hidden_states``/``output_attentions``, which ``forward()`` returns).  Backward hooks
    (``register_full_backward_hook``, ``register_full_backward_pre_hook``, the legacy
    ``register_backward_hook``, and their global forms) would never run, and may change the gradients,
    so a model with one is not captured (:class:`~remat_plugin.errors.CaptureError`): it falls back to
    per-layer checkpointing, which runs them, with a warning.  Hooks are part of the call's
    signature (:func:`hooks_state`), so one added or removed after planning captures again.
"""
from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterator

from torch import nn

from remat_plugin.errors import CaptureError
from remat_plugin.torch_private import global_module_hooks, module_hooks

log = logging.getLogger(__name__)

# Hooks defined here only compute tensors, bookkeep their own state, or collect outputs that forward() returns
_TRACED_AS_OPS = ("torch.", "remat_plugin.", "transformers.utils.output_capturing")
_told: weakref.WeakKeyDictionary[nn.Module, set[str]] = weakref.WeakKeyDictionary()


def _hook_name(hook: Callable) -> tuple[str, str]:
    """``(defining module, qualified name)`` of a hook: a function, a bound method, a partial or a callable object."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    target = hook if hasattr(hook, "__qualname__") else type(hook)
    return getattr(target, "__module__", None) or "", getattr(target, "__qualname__", type(hook).__name__)


def _hooks(module: nn.Module, kinds: tuple[bool, ...]) -> Iterator[tuple[str, str, str]]:
    """``(where, defining module, name)`` of each hook of these kinds (``True``: backward, ``False``: forward) on
    every module (global), then on ``module`` and its submodules, in one walk over them."""
    for backward in kinds:
        for hook in global_module_hooks(backward):
            yield ("every module (global)", *_hook_name(hook))
    for name, sub in module.named_modules():
        for backward in kinds:
            for hook in module_hooks(sub, backward):
                yield (name or type(module).__name__, *_hook_name(hook))


def hooks_state(module: nn.Module) -> str:
    """The model's hooks by where and what, for the call's signature ("" when it has none): a hook added or
    removed after planning is a new capture.  Names, not identities, so every rank computes the same."""
    return "|".join(sorted(f"{where}:{origin}.{name}" for where, origin, name in _hooks(module, (False, True))))


def _backward_hooks(module: nn.Module) -> list[str]:
    return [f"{name} on {where}" for where, _, name in _hooks(module, (True,))]


def _forward_hooks_of_the_user(module: nn.Module) -> list[str]:
    """Forward hooks other than PyTorch's, ours and transformers' (NOTE [module hooks]), sorted."""
    return sorted({f"{name} on {where}" for where, origin, name in _hooks(module, (False,))
                   if not origin.startswith(_TRACED_AS_OPS) and "enable_input_require_grads" not in name})


def user_hooks(module: nn.Module) -> list[str]:
    """Every backward hook, and the forward hooks that are not PyTorch's, ours or transformers' collectors:
    hooks whose Python a step run only to be metered would run again (NOTE [metered fallback])."""
    return sorted({*_backward_hooks(module), *_forward_hooks_of_the_user(module)})


def check_hooks(module: nn.Module) -> None:
    """Refuse backward hooks, and say once which forward hooks run only while tracing (NOTE [module hooks])."""
    backward = _backward_hooks(module)
    if backward:
        raise CaptureError(
            f"remat_plugin.capture: {type(module).__name__} has backward hooks ({', '.join(backward[:3])}"
            f"{', ...' if len(backward) > 3 else ''}), which a planned step would never run: its backward runs "
            "programs made from the traced graph, not the modules. Register them on tensors instead "
            "(tensor.register_hook, or on parameters), or remove them")
    traced = _forward_hooks_of_the_user(module)
    told = _told.setdefault(module, set())
    new = [t for t in traced if t not in told]
    if new:
        told.update(new)
        log.warning(
            "remat_plugin: %s has forward hooks (%s). They run while the graph is traced, not at each step: the "
            "tensor ops they compute are part of every planned step, but their Python side effects (a tensor "
            "stored or logged, a counter) happen once, on traced values. Return what they collect from forward() "
            "instead, or remove them", type(module).__name__, ", ".join(new[:3]) + (", ..." if len(new) > 3 else ""))
