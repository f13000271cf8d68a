"""Baseline strategies the plan is compared against, on the model's own parameters (no copies).

Each peer is a context manager over a :class:`~remat_plugin.bench.models.BenchModel`: entering it
rewires the model and yields ``step(args, kwargs) -> loss`` (forward only; the caller runs
backward), leaving restores the model exactly, even when the block raises::

    with per_layer_checkpoint(bench) as step:
        step(*bench.make_batch(0)).backward()

- ``none``: the unmodified model.
- ``per_layer_checkpoint``: every repeated layer under ``torch.utils.checkpoint`` (non-reentrant),
  which is what HF ``gradient_checkpointing_enable`` does; HF models use that switch itself.
- ``sqrt_n``: Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": the n layers cut
  into about sqrt(n) segments, only each segment's input kept, the segment recomputed in backward,
  for O(sqrt(n)) activation memory at the cost of one extra forward.

Like any plain ``torch.utils.checkpoint`` user, the checkpointing peers re-run BatchNorm's
running-statistics update during recomputation, so after a step the running stats (and
``num_batches_tracked``) differ from ``none``. Gradients are unaffected: in train mode BatchNorm
normalizes with batch statistics. The peers are kept faithful to what users get, not fixed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from remat_plugin.bench.models import BenchModel
from remat_plugin.solve.baselines import sqrt_n_segments

__all__ = ["PEERS", "Step", "none", "per_layer_checkpoint", "sqrt_n", "sqrt_n_segments"]

Step = Callable[[tuple[Any, ...], dict[str, Any]], torch.Tensor]


def _step(bench: BenchModel) -> Step:
    def step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return bench.loss(bench.module(*args, **kwargs))

    return step


@contextmanager
def none(bench: BenchModel) -> Iterator[Step]:
    """The unmodified model."""
    yield _step(bench)


@contextmanager
def per_layer_checkpoint(bench: BenchModel) -> Iterator[Step]:
    """Checkpoint every repeated layer on its own (HF ``gradient_checkpointing_enable`` semantics)."""
    if not bench.hf_gradient_checkpointing:
        with _checkpoint_segments(bench.layers, [[i] for i in range(len(bench.layers))]):
            yield _step(bench)
        return
    module: Any = bench.module
    # transformers 5.x renamed gradient_checkpointing_* to activation_checkpointing_*; the old names warn.
    if hasattr(module, "activation_checkpointing_enable"):
        was_enabled = module.is_activation_checkpointing
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        disable = module.activation_checkpointing_disable
    else:
        was_enabled = module.is_gradient_checkpointing
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        disable = module.gradient_checkpointing_disable
    try:
        yield _step(bench)
    finally:
        if not was_enabled:
            disable()


@contextmanager
def sqrt_n(bench: BenchModel) -> Iterator[Step]:
    """Chen's sqrt(n) segmentation: checkpoint each of about sqrt(n) runs of consecutive layers."""
    with _checkpoint_segments(bench.layers, sqrt_n_segments(len(bench.layers))):
        yield _step(bench)


PEERS: dict[str, Callable[[BenchModel], Any]] = {
    "none": none,
    "per_layer_checkpoint": per_layer_checkpoint,
    "sqrt_n": sqrt_n,
}


# NOTE [segment patching]
# The parent module calls its layers one by one, so a segment of several layers cannot be wrapped
# from outside without rewriting the parent's forward. Instead the instance ``forward`` of the
# segment's first layer is replaced by one that checkpoints the whole segment (running the layers'
# original forwards in order with the same extra arguments, the convention of BenchModel.layers),
# and the other layers of the segment pass the hidden tensor through. Only instance attributes are
# set, so deleting them (or putting back an instance ``forward`` that was already there) restores
# the class's ``forward``, hooks and all.


def _run_segment(forwards: list[Callable[..., Any]], hidden: Any, *args: Any, **kwargs: Any) -> Any:
    for forward in forwards:
        hidden = forward(hidden, *args, **kwargs)
    return hidden


def _checkpointed(run: Callable[..., Any], hidden: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(run, hidden, *args, use_reentrant=False, **kwargs)


def _pass_hidden(hidden: Any, *args: Any, **kwargs: Any) -> Any:
    return hidden


@contextmanager
def _checkpoint_segments(layers: list[nn.Module], segments: list[list[int]]) -> Iterator[None]:
    """Checkpoint each segment of ``layers`` (NOTE [segment patching]); restore on exit."""
    covered = sorted(i for segment in segments for i in segment)
    assert covered == list(range(len(layers))), f"segments {segments} do not partition {len(layers)} layers"
    _missing = object()
    saved = [layer.__dict__.get("forward", _missing) for layer in layers]
    try:
        for segment in segments:
            forwards = [layers[i].forward for i in segment]
            layers[segment[0]].forward = partial(_checkpointed, partial(_run_segment, forwards))
            for i in segment[1:]:
                layers[i].forward = _pass_hidden
        yield
    finally:
        for layer, forward in zip(layers, saved):
            if forward is _missing:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward
