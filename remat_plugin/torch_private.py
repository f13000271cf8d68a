"""Every private PyTorch API remat_plugin touches, in one place, checked against the tested torch versions.

Capture and execution lean on AOTAutograd's partitioner hooks, fake tensors and fx code
generation, none of which are public.  They move between releases (torch 2.14 began
asserting that every saved value's metadata is a fake tensor), so each one is imported
here and only here; a new torch release is ported by reading this file.

``TESTED_TORCH`` is the range CI runs (the core tests on each minor release, see the
Makefile).  Importing remat_plugin under another torch raises :class:`UnsupportedTorchError`
naming the installed and the tested versions; ``REMAT_ALLOW_UNTESTED_TORCH=1`` turns that
into a warning for people porting to a new release.
"""
from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._decomp import decompositions as _decompositions
from torch._functorch._aot_autograd.descriptors import (
    InputMutationAOTOutput,
    PlainAOTInput,
    PlainAOTOutput,
    SavedForBackwardsAOTOutput,
    SavedForBackwardsNoVcCheckAOTOutput,
    TangentAOTInput,
)
from torch._functorch._aot_autograd.utils import _is_primal as is_primal
from torch._functorch._aot_autograd.utils import _is_tangent as is_tangent
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import _extract_fwd_bwd_outputs as extract_fwd_bwd_outputs
from torch._functorch.partitioners import _extract_graph_with_inputs_outputs as extract_graph_with_inputs_outputs
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _BoxedCodeGen as BoxedCodeGen
from torch.multiprocessing.reductions import StorageWeakRef  # a weak reference to a storage, not to one tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.checkpoint import CheckpointFunction

from remat_plugin.errors import RematError

__all__ = [
    "TESTED_TORCH",
    "BoxedCodeGen",
    "FakeTensor",
    "FunctionalTensor",
    "InputMutationAOTOutput",
    "OpOverload",
    "PlainAOTInput",
    "PlainAOTOutput",
    "SavedForBackwardsAOTOutput",
    "SavedForBackwardsNoVcCheckAOTOutput",
    "StorageWeakRef",
    "TangentAOTInput",
    "TorchDispatchMode",
    "UnsupportedTorchError",
    "activation_memory_budget",
    "any_autocast_enabled",
    "aot_function",
    "autocast_devices",
    "autocast_disabled",
    "autocast_settings",
    "autocast_state",
    "batch_norm_laid_out_as_eager",
    "compile_segment",
    "extract_fwd_bwd_outputs",
    "extract_graph_with_inputs_outputs",
    "fake_on_storage",
    "in_backward",
    "is_compiled_module",
    "is_primal",
    "is_tangent",
    "lazy_graph_module",
    "partial_graph_unprinted",
    "profiler_active",
    "pytree",
    "queue_after_backward",
    "reentrant_checkpoints_inlined",
    "reset_dynamo",
    "suspended_user_modes",
    "tangent_output",
    "traced_like_eager",
    "unset_fake_temporarily",
    "user_modes_active",
    "without_donated_buffers",
]

TESTED_TORCH = ((2, 13), (2, 14))  # (major, minor) releases CI runs; see the Makefile


class UnsupportedTorchError(RematError, ImportError):
    """The installed torch is outside the range remat_plugin is tested on."""


def _check_version(version: str) -> None:
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    if (major, minor) in TESTED_TORCH:
        return
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
    message = (f"remat_plugin: torch {version} is not a tested release (tested: {tested}); remat_plugin relies on "
               f"private AOTAutograd APIs (remat_plugin/torch_private.py) that change between releases. Install a "
               f"tested torch (pip install 'torch>={TESTED_TORCH[0][0]}.{TESTED_TORCH[0][1]},"
               f"<{TESTED_TORCH[-1][0]}.{TESTED_TORCH[-1][1] + 1}'), or set REMAT_ALLOW_UNTESTED_TORCH=1 to try anyway")
    if os.environ.get("REMAT_ALLOW_UNTESTED_TORCH", "").strip().lower() in ("1", "true", "yes"):
        warnings.warn(message, stacklevel=3)
        return
    raise UnsupportedTorchError(message)


_check_version(torch.__version__)


def tangent_output(node: torch.fx.Node) -> int | None:
    """The flat output whose gradient a joint graph's tangent placeholder is (AOTAutograd's descriptor), or None."""
    desc = node.meta.get("desc")
    return desc.output.idx if isinstance(desc, TangentAOTInput) and isinstance(desc.output, PlainAOTOutput) else None


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A graph module that writes its Python code at its first call or ``.code``, not when made: the programs
    made while planning are rewritten (in-place adds, boxed codegen) or cut into segments before anything runs
    them, and each eager code generation costs about 30 us a node (0.1-0.2 s per capture of a 12-layer GPT-2)."""
    return _LazyGraphModule(root, graph)


def reset_dynamo() -> None:
    """Forget torch.compile's compiled code (a benchmark peer compiles the same module under several settings)."""
    torch._dynamo.reset()


def activation_memory_budget(ratio: float) -> contextlib.AbstractContextManager[None]:
    """torch.compile's min-cut partitioner keeps about ``ratio`` of its activations (the peer we compare with)."""
    return torch._functorch.config.patch(activation_memory_budget=ratio)


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward now running has finished every node (its saved tensors released); call
    it from inside a backward.  DDP's reducer finalizes its buckets the same way."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined]


def in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a checkpoint recomputation)."""
    return torch._C._current_graph_task_id() != -1


def without_donated_buffers(outputs: tuple) -> None:
    """Donate no saved buffer in the backward of the AOTAutograd function that made ``outputs``.

    A backward whose first run frees its saved tensors (no ``retain_graph``) is compiled with
    donated buffers, and refuses ``retain_graph=True`` ever after.  Our unobserved metered step
    may run that first backward before the caller's; it must not take ``retain_graph`` away.
    Our backward compiler runs the fx program as is: it has no use for donated buffers.
    """
    for t in outputs:
        forward_cls = getattr(getattr(t, "grad_fn", None), "_forward_cls", None)
        metadata = getattr(forward_cls, "metadata", None)
        if metadata is not None and hasattr(metadata, "bw_donated_idxs"):
            metadata.bw_donated_idxs = []
            return


def autocast_devices() -> list[str]:
    """The device types autocast can be enabled for in this build."""
    return list(torch._C._autocast_supported_devices())


def autocast_settings() -> tuple[tuple[str, torch.dtype, bool], ...]:
    """The caller's autocast, per device type where enabled: ``(device, dtype, cache_enabled)``, to enter again."""
    return tuple((device, torch.get_autocast_dtype(device), bool(torch.is_autocast_cache_enabled()))
                 for device in autocast_devices() if torch.is_autocast_enabled(device))


@contextlib.contextmanager
def autocast_as(state: tuple) -> Iterator[None]:
    """Autocast exactly as ``state`` (from :func:`autocast_settings`): on for its devices, off for the others."""
    with contextlib.ExitStack() as stack:
        on = {device for device, _, _ in state}
        for device in autocast_devices():
            if device not in on and torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        for device, dtype, cache in state:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        yield


def autocast_state() -> tuple[tuple[str, str, bool], ...]:
    """:func:`autocast_settings` with dtypes as text (a signature key)."""
    return tuple((device, str(dtype), cache) for device, dtype, cache in autocast_settings())


def compile_segment(gm: torch.fx.GraphModule) -> Callable[[list], Any]:
    """Inductor kernels for ``gm``, a graph of aten ops whose placeholders carry fake values; called boxed.

    ``compile_fx_inner`` is what ``torch.compile`` runs on each graph after AOTAutograd has
    partitioned it: it neither partitions nor recomputes.  The graph is first decomposed with
    inductor's table, as AOTAutograd would have done for it, and with torch._decomp's interpolations:
    the trace kept eager's kernels (NOTE [interpolations in the trace]) where ``torch.compile`` runs
    their Python decompositions, and inductor has no lowering for them (with ``CI`` set in the
    environment, as GitHub Actions sets it, inductor refuses to fall back to an op that has a
    decomposition).  Inductor's layout optimization is off:
    in a graph with convolutions it may hand values on in channels-last order, and the next segment
    (or an eager op between segments) was traced with the graph's strides (a conv model with bilinear
    resizes failed inductor's input stride assertion).
    """
    from torch._decomp import get_decompositions
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    example = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    fake_mode = detect_fake_mode(example)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        table = {**get_decompositions([op.overloadpacket for op in _interpolation_ops()]), **select_decomp_table()}
        decomposed = make_fx(gm, decomposition_table=table)(*example)
    decomposed.graph.set_codegen(torch.fx.graph.CodeGen())  # flat arguments and outputs, as inductor expects
    decomposed.recompile()
    with torch._inductor.config.patch(layout_optimization=False):
        return compile_fx_inner(decomposed, example)


def is_compiled_module(module: object) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper (``OptimizedModule``) around a module."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def any_autocast_enabled() -> bool:
    """Whether autocast is on for some device (in a backward: the caller ran ``backward()`` inside the block)."""
    return bool(torch._C._is_any_autocast_enabled())


def autocast_disabled() -> contextlib.AbstractContextManager[None]:
    """No autocast on any device inside (ops of a traced graph already carry their casts)."""
    return torch._C._DisableAutocast()


def _eager_dropout(input: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """``aten.dropout`` as eager PyTorch computes it (``at::native::dropout``), for the trace.

    Outside CUDA-like devices eager does not call ``native_dropout``: it multiplies by a noise
    tensor of the input's dtype (``bernoulli_(1-p)`` then ``div_(1-p)``), whose backward
    multiplies by that noise.  AOTAutograd's decomposition calls ``native_dropout``, whose
    backward multiplies by the scale in float: in bf16/fp16 the two round differently.
    Float32 and float64 round alike, so they keep ``native_dropout`` (a 1-byte mask to save).
    """
    fused = input.device.type not in ("cpu", "meta") or input.dtype not in (torch.bfloat16, torch.float16)
    if not train or p == 0 or fused:
        return _AOT_DROPOUT(input, p, train)
    if p == 1:
        return input * torch.zeros_like(input)
    noise = torch.empty_like(input).bernoulli_(1 - p)  # drawn as eager draws: NOTE [draw order]
    noise.div_(1 - p)
    return input * noise


_AOT_DROPOUT = _decompositions.dropout
_PYTHON_KERNEL_KEYS = (torch._C.DispatchKey.CompositeImplicitAutograd, torch._C.DispatchKey.Autograd)
# NOTE [interpolations in the trace]
#     Under the tracer's Python dispatcher the linear, bilinear, trilinear and bicubic interpolations run
#     torch._decomp's Python decompositions (registered for the Autograd and CompositeImplicitAutograd keys)
#     where eager runs the C++ kernels: a different sum of the same terms, and a backward derived from the
#     decomposition's gathers.  A float64 convolution's 9x9 output resized bilinearly to 5x7 gave a loss 2.8e-17
#     and gradients 3.3e-17 off eager's (MobileViT, whose unfolding resizes, 6e-13).  While a step is traced those
#     Python kernels are set aside, so the trace records the ops eager runs, ``upsample_bilinear2d`` and its
#     ``upsample_bilinear2d_backward`` among them.  Nearest-neighbour modes too: their decomposition gathers
#     (``_unsafe_index``), the same values, but its backward scatters into a row-major tensor
#     (``_unsafe_index_put``) where ``upsample_nearest2d_backward`` lays its result out as the incoming
#     gradient: a diffusers UNet's channels-last gradient (from its attention's reshapes) reached the next
#     convolution row-major, whose bias gradient summed in another order (1 ulp off eager's, float64).
_INTERPOLATIONS = ("upsample_linear1d.vec", "upsample_bilinear2d.vec", "upsample_trilinear3d.vec",
                   "upsample_bicubic2d.vec", "upsample_bilinear2d.default", "upsample_bicubic2d.default",
                   "_upsample_bilinear2d_aa.vec", "_upsample_bicubic2d_aa.vec",
                   "upsample_nearest1d.vec", "upsample_nearest2d.vec", "upsample_nearest3d.vec",
                   "upsample_nearest1d.default", "upsample_nearest2d.default", "upsample_nearest3d.default",
                   "_upsample_nearest_exact1d.vec", "_upsample_nearest_exact2d.vec", "_upsample_nearest_exact3d.vec",
                   "_upsample_nearest_exact1d.default", "_upsample_nearest_exact2d.default",
                   "_upsample_nearest_exact3d.default")


def _interpolation_ops() -> list[OpOverload]:
    return _overloads(_INTERPOLATIONS)


# NOTE [recurrent layers in the trace]
#     torch._decomp's Python kernels for multi-layer ``lstm``, ``gru``, ``rnn_tanh`` and ``rnn_relu``
#     (registered for the Autograd and CompositeImplicitAutograd keys, so the tracer's Python dispatcher runs
#     them) zero the dropout between layers: ``dropout if (train and num_layers < i - 1) else 0.0`` never
#     holds (torch 2.13 and 2.14).  A 3-layer ``nn.LSTM(dropout=0.3)`` in training was traced without its
#     dropouts: the planned step trained another model, its gradients 1e-3 off eager's, silently.
#     On CPU the trace now runs eager's own C++ composite kernel instead (``_op_dk``), which records the ops
#     eager runs, its dropout between layers included: bitwise eager's for float64 LSTMs and plain RNNs.  oneDNN is
#     switched off for that call: its ``mkldnn_rnn_layer`` (eager's float32 LSTM) returns the workspace its backward
#     reads only under grad mode, which the step's programs run without; a float32 LSTM is traced as the composite's
#     ops, 4e-9 off eager's oneDNN layer.  A GRU's gates, computed in place on strided chunks by eager, are computed
#     on contiguous tensors in the functionalized trace, where CPU's sigmoid can round otherwise (1 ulp).
#     Elsewhere (cuDNN draws its dropout from a state of its own, which a recomputation could not replay) the
#     Python kernel runs one layer at a time, with ``aten.dropout`` between layers as eager applies it, so those
#     dropouts are drawn and replayed as every other dropout of the step.
_RECURRENT = ("lstm.input", "lstm.data", "gru.input", "gru.data", "rnn_tanh.input", "rnn_tanh.data",
              "rnn_relu.input", "rnn_relu.data")
_RECURRENT_IN_EAGER_KERNEL = ("cpu",)  # devices whose trace runs eager's C++ kernel (a test empties it)


def _overloads(names: tuple[str, ...]) -> list[OpOverload]:
    found = []
    for name in names:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            found.append(op)
    return found


def _recurrent_kernel(op: OpOverload, python_kernel: Callable) -> Callable:
    """``op``'s kernel while a step is traced (NOTE [recurrent layers in the trace])."""
    packed = op._overloadname == "data"  # (data, batch_sizes, hx, params, ...) instead of (input, hx, params, ...)

    def kernel(*args):
        if args[0].device.type in _RECURRENT_IN_EAGER_KERNEL:
            enabled = torch._C._get_mkldnn_enabled()
            torch._C._set_mkldnn_enabled(False)  # oneDNN's layer keeps its workspace only under grad mode
            try:
                return op._op_dk(torch._C.DispatchKey.CompositeImplicitAutograd, *args)
            finally:
                torch._C._set_mkldnn_enabled(enabled)
        num_layers, dropout, train = args[5:8] if packed else args[4:7]
        if not (train and dropout > 0 and num_layers > 1):
            return python_kernel(*args)
        return _layer_by_layer(python_kernel, args, packed)

    return kernel


def _layer_by_layer(python_kernel: Callable, args: tuple, packed: bool) -> tuple:
    """A multi-layer recurrent op as one call per layer, ``aten.dropout`` between them (as eager's C++ applies it:
    to each layer's output but the last, sequence-major)."""
    first = 2 if packed else 1
    x, hx, params, has_biases, num_layers, dropout, train, bidirectional = args[first - 1 : first + 7]
    batch_first = False if packed else args[first + 7]
    directions = 2 if bidirectional else 1
    per_layer = len(params) // num_layers
    states = list(hx) if isinstance(hx, (list, tuple)) else [hx]
    if batch_first:
        x = x.transpose(0, 1)
    finals: list[list[torch.Tensor]] = [[] for _ in states]
    for layer in range(num_layers):
        layer_states = [s[layer * directions : (layer + 1) * directions] for s in states]
        layer_hx = layer_states if isinstance(hx, (list, tuple)) else layer_states[0]
        layer_params = params[layer * per_layer : (layer + 1) * per_layer]
        head = (x, args[1]) if packed else (x,)
        tail = () if packed else (False,)
        out = python_kernel(*head, layer_hx, layer_params, has_biases, 1, 0.0, train, bidirectional, *tail)
        x = out[0]
        for found, state in zip(finals, out[1:]):
            found.append(state)
        if layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    if batch_first:
        x = x.transpose(0, 1)
    return (x, *(torch.cat(found, 0) for found in finals))


# NOTE [batch norm layouts]
#     The Meta kernels of the batch norm ops (torch._decomp's, elementwise on the input) lay the output out as the
#     input, those of their backward as the output's gradient; the CPU kernels lay either out as
#     ``suggest_memory_format`` says of the input: row-major unless channels-last.  A
#     BatchNorm1d over a transposed tensor (PatchTST's ``batchnorm(x.transpose(1, 2)).transpose(1, 2)`` before a
#     Linear) was traced as strided where eager's is row-major, and the trace's ``view`` of it (the Linear's
#     flattening, legal for the traced strides) failed at the step's first run: "view size is not compatible"
#     (torch.compile's ``aot_eager`` fails alike, torch 2.13 and 2.14); so did the view of its backward's result.
#     While a model is exported and traced, these Meta kernels lay a CPU input's result out as the CPU kernel does.
#     Other devices are left as they are (not checked on one).  Other ops' views: NOTE [views of mistraced strides].
_BATCH_NORMS = {  # op -> the position of the input whose layout the CPU kernel's result takes
    "native_batch_norm.default": 0, "_native_batch_norm_legit.default": 0, "_native_batch_norm_legit.no_stats": 0,
    "_native_batch_norm_legit_functional.default": 0, "_native_batch_norm_legit_no_training.default": 0,
    "native_batch_norm_backward.default": 1, "batch_norm_backward.default": 1,
}


def _batch_norm_meta(meta: Callable, input_position: int) -> Callable:
    """``meta`` with its first result laid out as the CPU kernel lays it out: as ``suggest_memory_format`` says for
    the input at ``input_position`` (NOTE [batch norm layouts])."""
    from torch._prims_common import suggest_memory_format

    @functools.wraps(meta)  # fake tensors run a decomposition only if it names itself as torch._decomp's
    def kernel(*args, **kwargs):
        result = meta(*args, **kwargs)
        x = args[input_position]
        if x.device.type != "cpu" or not isinstance(result, (tuple, list)) or not isinstance(result[0], torch.Tensor):
            return result
        layout = suggest_memory_format(x)
        out = result[0]
        if out.is_contiguous(memory_format=layout):
            return result
        return (out.contiguous(memory_format=layout), *result[1:])

    return kernel


@contextlib.contextmanager
def batch_norm_laid_out_as_eager() -> Iterator[None]:
    """Inside, the batch norm ops' Meta kernels lay their output out as the CPU kernels do (NOTE [batch norm
    layouts])."""
    from torch._decomp import decomposition_table

    meta_key = torch._C.DispatchKey.Meta
    ops = {op: position for name, position in _BATCH_NORMS.items() for op in _overloads((name,))}
    kernels = [(op, op.py_kernels[meta_key]) for op in ops if meta_key in op.py_kernels]
    decompositions = [(op, decomposition_table[op]) for op in ops if op in decomposition_table]  # fake tensors' path
    try:
        for op, meta in kernels:
            op.py_kernels[meta_key] = _batch_norm_meta(meta, ops[op])
            op._dispatch_cache.clear()
        for op, decomposition in decompositions:
            decomposition_table[op] = _batch_norm_meta(decomposition, ops[op])
        yield
    finally:
        for op, meta in kernels:
            op.py_kernels[meta_key] = meta
            op._dispatch_cache.clear()
        for op, decomposition in decompositions:
            decomposition_table[op] = decomposition


@contextlib.contextmanager
def traced_like_eager(backward_autocast: bool = False) -> Iterator[None]:
    """AOTAutograd traces the joint graph the way eager PyTorch runs the step, bit for bit.

    - The backward is traced without autocast, as eager runs a ``loss.backward()`` called after
      the ``torch.autocast`` block, or, with ``backward_autocast``, under the forward's autocast,
      as eager runs one called inside it (the autograd engine carries the caller's autocast state).
    - ``aten.dropout`` decomposes as eager computes it (:func:`_eager_dropout`).
    - Interpolations run eager's kernels, not torch._decomp's Python ones (NOTE [interpolations in the trace]).
    - Multi-layer recurrent ops keep their dropout between layers (NOTE [recurrent layers in the trace]).
    - Batch norm outputs are laid out as the CPU kernels lay them out (NOTE [batch norm layouts]).
    """
    op = torch.ops.aten.dropout.default
    saved = {k: op.py_kernels.get(k) for k in _PYTHON_KERNEL_KEYS}
    set_aside = [(resize, k, resize.py_kernels.pop(k)) for resize in _interpolation_ops() for k in _PYTHON_KERNEL_KEYS
                 if k in resize.py_kernels]
    recurrent = [(rnn, k, rnn.py_kernels[k]) for rnn in _overloads(_RECURRENT) for k in _PYTHON_KERNEL_KEYS
                 if k in rnn.py_kernels]
    try:
        for k in _PYTHON_KERNEL_KEYS:
            op.py_kernels[k] = _eager_dropout
        op._dispatch_cache.clear()
        for resize, _, _ in set_aside:
            resize._dispatch_cache.clear()
        for rnn, k, python_kernel in recurrent:
            rnn.py_kernels[k] = _recurrent_kernel(rnn, python_kernel)
            rnn._dispatch_cache.clear()
        with torch._functorch.config.patch(backward_pass_autocast="same_as_forward" if backward_autocast else "off"), \
                batch_norm_laid_out_as_eager():
            yield
    finally:
        for k, fn in saved.items():
            if fn is None:
                op.py_kernels.pop(k, None)
            else:
                op.py_kernels[k] = fn
        op._dispatch_cache.clear()
        for replaced, k, kernel in set_aside + recurrent:
            replaced.py_kernels[k] = kernel
            replaced._dispatch_cache.clear()


def unbacked_reads_ignored(tensors: list[torch.Tensor]) -> contextlib.AbstractContextManager[None]:
    """While export traces a call on these fake tensors, a value it reads (a tensor check, NOTE [tensor checks])
    makes a number nothing returns: export refuses such pending numbers, unless its shape environment is told
    to let them be (a traced-once layer's fingerprint only wants the outputs' metadata)."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(tensors)
    shape_env = getattr(mode, "shape_env", None)
    return shape_env.ignore_fresh_unbacked_symbols() if shape_env is not None else contextlib.nullcontext()


def fake_on_storage(mode: Any, storage: torch.UntypedStorage | None, like: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``mode`` shaped like ``like`` (size, strides, offset, dtype, device) on ``storage`` (a meta
    or fake storage; None: a new one of ``like``'s storage size).  Built on the meta device and wrapped, not
    dispatched through the fake mode: 20x faster, for the thousands of values a spliced graph holds."""
    with unset_fake_temporarily():
        if storage is None:
            storage = torch.empty(like.untyped_storage().nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
        meta = torch.empty((0,), dtype=like.dtype, device="meta").set_(
            storage, like.storage_offset(), like.shape, like.stride())
        return FakeTensor(mode, meta, like.device)


def module_hooks(module: torch.nn.Module, backward: bool) -> list[Callable]:
    """The forward (pre-)hooks or the backward (pre-)hooks registered on ``module`` itself."""
    kinds = ("_backward_pre_hooks", "_backward_hooks") if backward else ("_forward_pre_hooks", "_forward_hooks")
    return [hook for kind in kinds for hook in getattr(module, kind, {}).values()]


_FORWARD_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


@contextlib.contextmanager
def forward_hooks_off(module: torch.nn.Module) -> Iterator[None]:
    """Inside, calling ``module`` runs its ``forward`` without the forward (pre-)hooks registered on it."""
    saved = {name: getattr(module, name) for name in _FORWARD_HOOK_DICTS if hasattr(module, name)}
    for name, hooks in saved.items():
        setattr(module, name, type(hooks)())
    try:
        yield
    finally:
        for name, hooks in saved.items():
            setattr(module, name, hooks)


_TENSOR_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")  # Tensor.register_hook and its kin


@contextlib.contextmanager
def suspended_tensor_hooks(tensors: Iterable[torch.Tensor],
                           stand_in: Callable[[torch.Tensor], Any] | None = None) -> Iterator[None]:
    """Inside, the hooks registered on ``tensors`` (``register_hook``, ``register_post_accumulate_grad_hook``) do
    not run; on exit they are back, in order.  Autograd reads each tensor's own hook dictionary when a gradient
    arrives, so emptying that dictionary in place turns them off and refilling it turns them on again.
    ``stand_in``: run instead of a tensor's gradient hooks (``register_hook``), where it had some."""
    emptied: list[tuple[dict, dict]] = []
    try:
        for t in tensors:
            for name in _TENSOR_HOOK_DICTS:
                hooks = getattr(t, name, None)
                if hooks:
                    emptied.append((hooks, dict(hooks)))
                    hooks.clear()
                    if stand_in is not None and name == "_backward_hooks":
                        hooks[-1] = stand_in  # keyed as no handle of torch's is (theirs count up from 0)
        yield
    finally:
        for hooks, saved in emptied:
            hooks.clear()
            hooks.update(saved)


def global_module_hooks(backward: bool) -> list[Callable]:
    """The forward (pre-)hooks or the backward (pre-)hooks registered for every module
    (``torch.nn.modules.module.register_module_forward_hook`` and kin)."""
    from torch.nn.modules import module as torch_module

    kinds = ("_global_backward_pre_hooks", "_global_backward_hooks") if backward else \
        ("_global_forward_pre_hooks", "_global_forward_hooks")
    return [hook for kind in kinds for hook in getattr(torch_module, kind, {}).values()]


def profiler_active() -> bool:
    """Whether a ``torch.profiler`` session (the caller's, or one of our meters) is recording on this process."""
    return bool(torch._C._autograd._profiler_enabled())


def user_modes_active() -> bool:
    """Whether the caller has a ``TorchDispatchMode`` or ``TorchFunctionMode`` (a FLOP counter, a tracker) active."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._len_torch_function_stack() > 0


@contextlib.contextmanager
def suspended_user_modes() -> Iterator[None]:
    """The caller's dispatch and function modes are off inside, and back, in order, on exit.

    Capture traces with fake tensors; a user's mode that reads data (a memory tracker's
    ``data_ptr``) fails on them, and one that counts ops would count the tracing.
    """
    function_modes = []
    while torch._C._len_torch_function_stack() > 0:
        function_modes.append(torch._C._pop_torch_function_stack())
    try:
        with _disable_current_modes():
            yield
    finally:
        for mode in reversed(function_modes):
            torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def reentrant_checkpoints_inlined() -> Iterator[None]:
    """Inside, ``torch.utils.checkpoint``'s reentrant form (``use_reentrant=True``, HF's gradient checkpointing with
    those kwargs) runs its function directly.

    Its autograd.Function runs the function under ``no_grad``, so ``torch.export`` saw no gradient path through
    it and the step had nothing to plan.  Capture only needs the function's ops: the plan decides what is
    recomputed, and the gradients are the function's, as reentrant checkpointing's are.  Where no tensor
    argument requires grad, reentrant checkpointing gives the function's parameters no gradient (its known
    pitfall); the function then runs under ``no_grad`` here too, so the step is eager PyTorch's either way.
    """
    own = CheckpointFunction.__dict__.get("apply")

    def apply(cls, function, preserve_rng_state, *args):
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return function(*args)
        with torch.no_grad():
            return function(*args)

    CheckpointFunction.apply = classmethod(apply)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del CheckpointFunction.apply
        else:
            CheckpointFunction.apply = own  # type: ignore[method-assign]


@contextlib.contextmanager
def partial_graph_unprinted() -> Iterator[None]:
    """Inside, a failing ``torch.export.export`` does not print its partial graph to stderr (torch's export wrapper
    prints ``exc.partial_fx_graph`` before it re-raises: thousands of lines per failed export of a large model, our
    one-line fallback warning lost beneath, once per export attempt).  The graph goes to the debug log; anything
    else written to stderr meanwhile is written after."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException as exc:
        partial = getattr(exc, "partial_fx_graph", None)
        text = buffer.getvalue()
        if partial is not None:
            text = text.replace(f"{partial}\n", "")  # printed by each of export's nested wrappers
            logging.getLogger("remat_plugin.capture").debug("torch.export's partial graph:\n%s", partial)
        sys.stderr.write(text)
        raise
    sys.stderr.write(buffer.getvalue())
