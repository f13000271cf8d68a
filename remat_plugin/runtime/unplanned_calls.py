"""A backward through a call the plan does not run: an eval-mode call with gradients on.

NOTE [eval-mode backward]
    A planned module runs its original forward, unplanned, where no training call is being made: under
    ``no_grad``/``inference_mode``, and in eval mode (validation loops that forget ``no_grad`` build a graph
    nobody differentiates, and planning them would cost a capture per shape).  A loop that trains in eval
    mode (dropout off, BatchNorm frozen by ``model.eval()``) ran its backward outside the budget, silently.
    Each such call's outputs that require grad carry a hook: the first backward that reaches one says so
    once per model, with the fix (train mode, with ``.eval()`` on the submodules to freeze).  The hook
    returns nothing, so gradients are the call's own.  :func:`is_planned_call` and :func:`run_unplanned` hold
    this rule for every entry point (``rematerialize``, sessions, ``rematerialize_fsdp``'s units).
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from remat_plugin.torch_private import pytree

log = logging.getLogger(__name__)

_told: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def watch_eval_backward(module: nn.Module, output: Any) -> Any:
    """``output``, whose tensors requiring grad say once, when a backward reaches them, that ``module``'s eval-mode
    call ran unplanned (NOTE [eval-mode backward]).  Called with grad on; a no-op once told."""
    if module in _told:
        return output
    ref = weakref.ref(module)

    def reached(grad: torch.Tensor) -> None:
        model = ref()
        if model is None or model in _told:
            return
        _told.add(model)
        log.warning(
            "remat_plugin: backward() ran through a call of %s in eval mode. Eval-mode calls run the model as it is, "
            "unplanned, so that step's memory is not bounded by the budget. To train with dropout off or BatchNorm "
            "frozen, keep the model in train mode and call .eval() on those submodules (the plan follows them); "
            "for validation, wrap the calls in torch.no_grad()", type(model).__name__)

    for leaf in pytree.tree_leaves(output):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            leaf.register_hook(reached)
    return output


def is_planned_call(model: nn.Module) -> bool:
    """Whether a call of ``model`` (or of a part of it) is a training call, planned: grad mode on and ``model`` in
    train mode.  Other calls run as written (NOTE [eval-mode backward])."""
    return torch.is_grad_enabled() and model.training


def run_unplanned(model: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``forward(*args, **kwargs)`` as written, for a call of ``model`` that :func:`is_planned_call` does not plan;
    with grad mode on, its outputs say a backward through them (:func:`watch_eval_backward`)."""
    output = forward(*args, **kwargs)
    return watch_eval_backward(model, output) if torch.is_grad_enabled() else output
