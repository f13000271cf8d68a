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
- ``drop_cheap``: Chen et al. 2016, section 4.2, "Drop the results of low cost operations": keep
  what is expensive to compute, recompute the cheap ops (NOTE [drop cheap ops]).
- ``compiled_memory_budget``: ``torch.compile`` with ``torch._functorch.config.activation_memory_budget``
  (the min-cut partitioner's knapsack), the strongest mainstream automatic peer. It takes a ratio
  and compiles once, so it is not in :data:`EAGER_PEERS`; see its docstring for how to measure it.

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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from remat_plugin.bench.bench_model import BenchModel
from remat_plugin.capture.forward_swap import swapped_forwards
from remat_plugin.planning.baselines import sqrt_n_segments
from remat_plugin.torch_private import activation_memory_budget, reset_dynamo

__all__ = [
    "EAGER_PEERS", "EXPENSIVE_OPS", "Step", "applicable_peers", "compiled_memory_budget", "drop_cheap", "none", "per_layer_checkpoint",
    "sqrt_n", "sqrt_n_segments",
]  # fmt: skip

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
    if not bench.layers_chain:
        raise ValueError(f"bench.peers: sqrt_n needs {bench.name}'s layers to form one chain (each layer's output the "
                         "next one's input); it has several stacks. Use per_layer instead.")
    with _checkpoint_segments(bench.layers, sqrt_n_segments(len(bench.layers))):
        yield _step(bench)


# NOTE [drop cheap ops]
# Chen et al. (section 4.2) keep "the result of convolution, but drop the result of the batch
# normalization, activation function and pooling": recomputing those costs little time and frees
# their outputs. Their rule is about ops, not layers, so the faithful PyTorch form is selective
# activation checkpointing: each repeated layer runs under non-reentrant ``torch.utils.checkpoint``
# with a policy that marks the outputs of the expensive ops MUST_SAVE (kept, never recomputed) and
# every other op PREFER_RECOMPUTE (dropped, recomputed in backward from the saved ones and the
# layer's input). "Expensive" is what dominates FLOPs in these models: matrix products, convolutions
# and fused attention kernels. Dropout is recomputed with the RNG state checkpoint restores, so
# gradients stay equal to the plain model's. Like per-layer checkpointing it only covers the
# repeated layers; embeddings and heads keep everything.

_aten = torch.ops.aten
EXPENSIVE_OPS = frozenset({
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.convolution,
    _aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_cudnn_attention,
})  # fmt: skip


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective-checkpoint policy of NOTE [drop cheap ops]."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in EXPENSIVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def drop_cheap(bench: BenchModel) -> Iterator[Step]:
    """Chen's "drop the results of low cost operations", per repeated layer (NOTE [drop cheap ops])."""
    context_fn = partial(create_selective_checkpoint_contexts, _keep_expensive)
    with _checkpoint_segments(bench.layers, [[i] for i in range(len(bench.layers))], context_fn):
        yield _step(bench)


@contextmanager
def compiled_memory_budget(bench: BenchModel, ratio: float, backend: str | None = None) -> Iterator[Step]:
    """``torch.compile(bench.module)`` with ``activation_memory_budget=ratio`` for as long as the block runs.

    The ratio is read when the graph is partitioned, at the first call, and again at any recompile,
    so the config patch stays on for the whole block, and dynamo's caches are reset on entry and
    exit so no graph of another ratio is reused. ``backend`` defaults to ``inductor`` on CUDA and
    ``aot_eager`` elsewhere (same partitioner, no codegen). Measure its memory with a meter that sees
    compiled code (``capture.memory_meter.measure_peak_profiler`` on CPU, the CUDA counters on GPU): while a
    ``TorchDispatchMode`` such as the CPU ``PeakMeter`` is active dynamo runs the model eagerly, and
    the compiled module keeps running eagerly after it (seen with torch 2.13).
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"bench.peers: activation_memory_budget must lie in [0, 1], got {ratio}; pick e.g. 0.5.")
    param = next(bench.module.parameters(), None)
    if backend is None:
        backend = "inductor" if param is not None and param.device.type == "cuda" else "aot_eager"
    reset_dynamo()
    compiled = torch.compile(bench.module, backend=backend)

    def step(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        return bench.loss(compiled(*args, **kwargs))

    try:
        with activation_memory_budget(ratio):
            yield step
    finally:
        reset_dynamo()


# The eager peers by report name, in report order; "none" first, it is the reference of every other strategy.
EAGER_PEERS: dict[str, Callable[[BenchModel], Any]] = {
    "none": none,
    "per_layer": per_layer_checkpoint,
    "sqrt_n": sqrt_n,
    "drop_cheap": drop_cheap,
}


def applicable_peers(bench: BenchModel, names) -> list[str]:
    """``names`` without the peers that cannot run on ``bench``: sqrt(n) segments of several layers
    need the layers to form one chain (not an encoder-decoder's two stacks or a U-Net's levels)."""
    return [name for name in names if name != "sqrt_n" or bench.layers_chain]


# NOTE [segment patching]
# The parent module calls its layers one by one, so a segment of several layers cannot be wrapped
# from outside without rewriting the parent's forward. Instead the instance ``forward`` of the
# segment's first layer is replaced by one that checkpoints the whole segment (running the layers'
# original forwards in order with the same extra arguments, the convention of BenchModel.layers),
# and the other layers of the segment pass the hidden tensor through. The swap and its exact
# restore are ``capture.forward_swap``'s: only instance attributes are set, so the class's
# ``forward``, hooks and all, shows again on exit.


def _run_segment(forwards: list[Callable[..., Any]], hidden: Any, *args: Any, **kwargs: Any) -> Any:
    for forward in forwards:
        hidden = forward(hidden, *args, **kwargs)
    return hidden


def _checkpointed(
    run: Callable[..., Any], context_fn: Callable[[], Any] | None, hidden: Any, *args: Any, **kwargs: Any
) -> Any:
    if context_fn is None:
        return checkpoint(run, hidden, *args, use_reentrant=False, **kwargs)
    return checkpoint(run, hidden, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _pass_hidden(hidden: Any, *args: Any, **kwargs: Any) -> Any:
    return hidden


@contextmanager
def _checkpoint_segments(
    layers: list[nn.Module], segments: list[list[int]], context_fn: Callable[[], Any] | None = None
) -> Iterator[None]:
    """Checkpoint each segment of ``layers`` (NOTE [segment patching]), with ``context_fn`` if given; restore on exit."""
    covered = sorted(i for segment in segments for i in segment)
    assert covered == list(range(len(layers))), f"segments {segments} do not partition {len(layers)} layers"
    forwards = [layer.forward for layer in layers]  # the originals, read before any is swapped
    replacements: dict[int, Callable[..., Any]] = {}
    for segment in segments:
        run = partial(_run_segment, [forwards[i] for i in segment])
        replacements[id(layers[segment[0]])] = partial(_checkpointed, run, context_fn)
        replacements.update((id(layers[i]), _pass_hidden) for i in segment[1:])
    with swapped_forwards(layers, lambda layer, _forward: replacements[id(layer)]):
        yield
