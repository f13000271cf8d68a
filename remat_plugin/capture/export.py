"""Capture a module for one input signature and build its planned forward+backward.

Capture goes through ``torch.export`` (training IR, ``strict=False``), whose module
shares the original ``Parameter`` objects; AOTAutograd then traces the joint
forward+backward of that module and hands it to our partitioner, which plans and
emits the programs (see :mod:`remat_plugin.capture.programs`).
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from remat_plugin.capture.assigned_tensors import AssignedTensors, CallDerived
from remat_plugin.capture.autograd_functions import opaque_functions, restore_functions
from remat_plugin.capture.capture_failures import export_failure, untraceable
from remat_plugin.capture.cast_cache import cast_by_the_model, share_parameter_casts
from remat_plugin.capture.compiled_programs import compile_program
from remat_plugin.capture.dataclass_trees import outputs_registered
from remat_plugin.capture.draw_order import draws_in_memory_order
from remat_plugin.capture.dropout_masks import split_dropouts
from remat_plugin.capture.dropped_tangents import (
    FilledTangents,
    fold_dropped_tangents,
    keep_missing_gradients,
    relaid_tangents,
    some_gradient_reads_part_of_the_tangents,
)
from remat_plugin.capture.forward_effects import MUTATED_INPUTS_META, mutated_inputs, refuse_unreplayable_effects
from remat_plugin.capture.graded_constants import GradedTensors
from remat_plugin.capture.hf_masks import eager_masks
from remat_plugin.capture.host_random import HostDraws
from remat_plugin.capture.in_place_adds import add_in_place, sums_in_place
from remat_plugin.capture.joint import JointGraph
from remat_plugin.capture.layer_splice import NotSpliceable
from remat_plugin.capture.module_attributes import Guard, traced_values, with_tensors
from remat_plugin.capture.module_hooks import check_hooks
from remat_plugin.capture.output_usage import OutputUsage, outputs_beside_the_loss, watched
from remat_plugin.capture.repeated_layers import RepeatedLayers
from remat_plugin.capture.segments import MAX_SEGMENTS, SegmentedBackward, compiled_node, ordered_first_call
from remat_plugin.capture.stride_fallbacks import views_copied_if_needed
from remat_plugin.capture.tensor_checks import opaque_tensor_checks
from remat_plugin.capture.tensor_hooks import ForwardHooks
from remat_plugin.errors import CaptureError, RematError
from remat_plugin.torch_private import (
    BoxedCodeGen,
    InputMutationAOTOutput,
    PlainAOTInput,
    aot_function,
    autocast_settings,
    batch_norm_laid_out_as_eager,
    extract_fwd_bwd_outputs,
    is_tangent,
    partial_graph_unprinted,
    pytree,
    reentrant_checkpoints_inlined,
    suspended_user_modes,
    traced_like_eager,
    without_donated_buffers,
)

log = logging.getLogger(__name__)

_RECURRENT_WEIGHTS_WARNING = r"The tensor attributes (self\.[\w.]*_flat_weights\[\d+\](, )?)+ were assigned during export"


def export_module(module: nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    """``torch.export``'s module, its autograd Functions kept (NOTE [autograd Functions]), with a
    :class:`CaptureError` that names the failing op or line."""
    draws, hooks, graded, assigned = HostDraws(), ForwardHooks(), GradedTensors(), AssignedTensors()
    try:
        # suspended_user_modes: the caller's FLOP counter or memory tracker would meet fake tensors
        with suspended_user_modes(), reentrant_checkpoints_inlined(), opaque_functions(), draws.restored(), \
                eager_masks(), hooks.recorded(), outputs_registered(module), warnings.catch_warnings(), \
                partial_graph_unprinted(), batch_norm_laid_out_as_eager():
            # nn.LSTM/GRU/RNN keep a list of their weights that export's parameter swap rewrites: nothing to fix
            warnings.filterwarnings("ignore", message=_RECURRENT_WEIGHTS_WARNING)
            with graded, assigned.recorded(module):
                exported = torch.export.export(module, args, kwargs, strict=False)
            if assigned.caches and not hooks.calls:
                # new attributes with no gradient: caches, or computed from the call? A second trace follows the
                # call's tensors, for such models only (NOTE [tensors the forward keeps])
                assigned = AssignedTensors()
                with assigned.recorded(module, CallDerived()):
                    torch.export.export(module, args, kwargs, strict=False)
    except Exception as exc:  # export raises many types; all mean "this model cannot be captured"
        raise export_failure(exc, module, kwargs, caller_file=__file__) from exc
    draws.check(type(module).__name__)  # NOTE [host random draws]
    hooks.check(type(module).__name__)  # NOTE [hooks in the forward]
    graded.check(module, args, kwargs)  # NOTE [graded constants]
    assigned.check(type(module).__name__)  # NOTE [tensors the forward keeps]
    gm = restore_functions(exported.module())
    gm.meta[HELD_META] = frozenset(id(v) for m in module.modules() for v in vars(m).values()
                                   if isinstance(v, torch.Tensor))  # graph_text's constants of the model's own
    gm.meta[MUTATED_INPUTS_META] = mutated_inputs(exported)  # NOTE [inputs written by the forward]
    refuse_unreplayable_effects(gm, type(module).__name__)
    opaque_tensor_checks(gm)  # NOTE [tensor checks]
    return gm


@dataclass(frozen=True)
class ExecutionOptions:
    """How a step's programs are traced and run; the plan (what is kept, what recomputed) is the same."""

    backward_autocast: bool = False  # the caller's backward() runs inside its autocast block (traced_like_eager)
    compile: bool = False  # the programs run as inductor kernels (NOTE [compiled programs])
    # Eager backward in up to this many autograd nodes, releasing gradients as it goes (NOTE [segmented backward]);
    # 1: one node, every gradient at the end.  Compiled programs always run as one node.
    backward_segments: int = MAX_SEGMENTS
    # Route the outputs through _WatchedOutputs (output usage, the double-backward refusal).  Off for FSDP2 units,
    # whose outputs must not be views: FSDP's pre-backward hook on a view is lost to a caller's in-place op.
    watch_outputs: bool = True
    # Trace one layer of each kind of the model's repeated layers and splice it in at every call
    # (NOTE [layers traced once]) instead of tracing every layer.
    layers_once: bool = True


EAGER = ExecutionOptions()


# NOTE [planning runs]
#     A step is planned by its first call: AOTAutograd traces the joint graph, our partitioner
#     plans it, and then AOTAutograd runs the forward program it was handed.  Where that call is
#     made only to plan (``rematerialize``'s prepare, a re-plan before the caller's step), its
#     outputs are dropped and buffers and RNG restored, so running the forward is pure cost: a
#     whole forward of the model (1.0 s of a cold plan of 12 gpt2-tiny layers).  With
#     ``CompiledStep.planning_only`` set, the eager forward program returns tensors of its outputs'
#     sizes and strides without computing them, and each input it would update in place (a
#     BatchNorm buffer) is returned as it is, so the update writes the input onto itself.  A program
#     whose outputs it cannot stand for (anything but tensors, constants and plain inputs' updates,
#     whose sizes match) runs.  Compiled programs always run: inductor compiles at that first call.
def _unrun_outputs(gm: torch.fx.GraphModule) -> Callable[[list], list | None] | None:
    """What a forward program returns when it is not run (NOTE [planning runs]), or None where it must run.

    Each output keeps its aliasing: a view of an input (a saved transposed weight) is that view of the real
    input, and outputs sharing a storage share one new storage of its size, so skipping the forward never
    allocates more than running it.
    """
    output = gm.graph.output_node()
    values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in cast(tuple, output.args[0])]
    descs = output.meta.get("desc")
    if descs is None or len(descs) != len(values):
        return None
    inputs: dict[int, int] = {}  # fake storage -> the position of an input on it
    for k, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            inputs.setdefault(val.untyped_storage()._cdata, k)
    updated: dict[int, int] = {}  # output position -> the flat input it is the new value of
    for i, (value, desc) in enumerate(zip(values, descs)):
        if isinstance(desc, InputMutationAOTOutput):
            if not isinstance(desc.mutated_input, PlainAOTInput) or not isinstance(value, torch.Tensor):
                return None
            updated[i] = desc.mutated_input.idx
        elif not (isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float))):
            return None
    metas = [(tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype, v.device, v.untyped_storage()._cdata,
              v.untyped_storage().nbytes()) if isinstance(v, torch.Tensor) else None for v in values]

    def unrun(args: list) -> list | None:
        outs: list = []
        made: dict[int, torch.UntypedStorage] = {}
        for i, (value, meta) in enumerate(zip(values, metas)):
            if meta is None:
                outs.append(value)
                continue
            size, stride, offset, dtype, device, key, nbytes = meta
            if i in updated:
                old = args[updated[i]]
                if (tuple(old.shape), tuple(old.stride()), old.dtype, old.device) != (size, stride, dtype, device):
                    return None  # its metadata changes: the program runs
                outs.append(old)
            elif key in inputs:
                outs.append(torch.as_strided(args[inputs[key]], size, stride, offset))
            else:
                if key not in made:
                    made[key] = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
                outs.append(torch.empty(0, dtype=dtype, device=device).set_(made[key], offset, size, stride))
        return outs

    return unrun


@dataclass
class CompiledStep:
    """One input signature's planned function; call it with the user's args/kwargs."""

    fn: Callable
    params: list[torch.Tensor]
    tensor_positions: list[int]
    out_spec: Any = None
    out_constants: dict[int, Any] = field(default_factory=dict)
    out_tensor_positions: list[int] = field(default_factory=list)
    usage: OutputUsage | None = None  # of the latest call whose backward has begun
    traced: bool = False
    options: ExecutionOptions = EAGER  # where the caller's backward() runs (traced_like_eager), compiled or not
    programs: list[Callable] = field(default_factory=list)  # the forward and backward programs, once traced
    backward: SegmentedBackward | None = None  # the eager backward program, once built (NOTE [segmented backward])
    trace_started: float | None = None  # time.perf_counter() as the first call began tracing
    absent_tangents: frozenset[str] = frozenset()  # dropped outputs' tangents, left None (NOTE [dropped tangents])
    # Tangents a missing gradient fills laid out as the gradient they are added into (NOTE [relaid tangents])
    relaid_tangents: dict[str, torch.Tensor] = field(default_factory=dict)
    # Some gradient reads only some tangents: missing ones may leave it None (NOTE [gradients no tangent reaches])
    partial_gradients: bool = False
    # The exported module its joint graph is traced from: a new plan of the same call (the outputs the caller
    # drops, a calibration correction) traces it again instead of exporting the model anew.
    exported: torch.fx.GraphModule | None = None
    # Traces the step again with every layer, for a model whose layers turned out not to splice (NOTE [layers
    # traced once]); None once used, or where every layer was traced from the start.
    traced_whole: Callable[[], Callable] | None = None
    model_name: str = ""
    planning_only: bool = False  # a call made only to plan: the forward program need not run (NOTE [planning runs])
    out_scalars: list[int] = field(default_factory=list)  # flat tensor outputs of one floating element (a loss)
    ungraded_outputs: frozenset[int] = frozenset()  # flat tensor outputs held but given no gradient, once traced
    # Called with the usage its backward sees, before anything is recorded: raises to refuse a usage the plan
    # cannot run within its budget (NOTE [loss-only first plan] in remat_plugin.runtime.resolver).
    refuse_usage: Callable[[OutputUsage], None] | None = None
    freed_outputs: frozenset[int] = frozenset()  # flat tensor outputs the plan frees after the forward
    joint_seen: bool = False  # the trace reached the joint graph: later failures are planning's, not the trace's
    # Given the CaptureError of a graph AOTAutograd could not trace (NOTE [untraceable graphs]), what runs the call
    # instead (the per-layer fallback), and every later one; None: the error is raised.
    on_untraceable: Callable[[CaptureError], Callable[[tuple, dict], Any]] | None = None
    instead: Callable[[tuple, dict], Any] | None = None
    guard: Guard | None = None  # the modules' Python values the graph holds (NOTE [module attributes])

    def __call__(self, args: tuple, kwargs: dict):
        if self.instead is not None:
            return self.instead(args, kwargs)
        leaves, _ = pytree.tree_flatten((args, kwargs))
        inputs: list = [*self.params, *(leaves[i] for i in self.tensor_positions)]
        if self.traced:
            call = None
            if self.backward is not None and torch.is_grad_enabled():
                inputs, call = self.backward.wire(inputs)
            flat_out = self.fn(*inputs)
            if call is not None:
                SegmentedBackward.attach(call, flat_out)
        else:
            self.trace_started = time.perf_counter()
            if self.traced_whole is not None and not (torch.is_grad_enabled() and any(
                    isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)):
                self.fn, self.traced_whole = self.traced_whole(), None  # an inference graph: no joint to splice into
            if self.options.backward_segments > 1 and not self.options.compile and torch.is_grad_enabled():
                inputs = ordered_first_call(inputs)  # NOTE [first call order]
            try:
                flat_out = self._trace(inputs)
            except RematError:
                raise
            except Exception as exc:  # NOTE [untraceable graphs]
                if self.joint_seen:
                    raise
                err = untraceable(exc, self.exported, self.model_name)
                if self.on_untraceable is None:
                    raise err from exc
                self.instead = self.on_untraceable(err)
                return self.instead(args, kwargs)
            self.traced = True
        if (self.absent_tangents or self.relaid_tangents or self.partial_gradients) and torch.is_grad_enabled():
            self._keep_missing_gradients(flat_out)
        without_donated_buffers(flat_out)
        if self.options.watch_outputs:
            flat_out = watched(flat_out, self._record, self.options.backward_autocast, self.freed_outputs,
                                self._amend, owner=self.params[0] if self.params else None)
        n = len(self.out_tensor_positions) + len(self.out_constants)
        out_leaves: list[Any] = [None] * n
        for pos, t in zip(self.out_tensor_positions, flat_out):
            out_leaves[pos] = t
        for pos, c in self.out_constants.items():
            out_leaves[pos] = c
        return pytree.tree_unflatten(out_leaves, self.out_spec)

    def _trace(self, inputs: list) -> Any:
        with traced_like_eager(self.options.backward_autocast):  # the first call traces the joint graph
            try:
                return self.fn(*inputs)
            except NotSpliceable as exc:
                if self.traced_whole is None:
                    raise
                _warn_traced_whole(self.model_name, exc)
                self.fn, self.traced_whole = self.traced_whole(), None
                self.joint_seen = False  # the splice failed on the joint graph; the whole trace starts afresh
                return self.fn(*inputs)

    def _record(self, usage: OutputUsage) -> None:
        if self.refuse_usage is not None:
            self.refuse_usage(usage)
        self.usage = usage

    def _amend(self, seen: OutputUsage, amended: OutputUsage) -> None:
        """``seen``, recorded as the backward began, seen again after it (:class:`_OutputWatch`); not refused
        again: the refusal decided, on every rank at once, before the backward ran, and holding an output the
        plan keeps is no use it refuses."""
        if self.usage is seen:  # not taken yet, nor replaced by a later call's
            self.usage = amended

    def _keep_missing_gradients(self, flat_out: tuple) -> None:
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat_out):
            return  # nothing to differentiate this call (parameters frozen since): no node to tell
        node = compiled_node(flat_out)
        if node is None:
            raise CaptureError(
                "remat_plugin.execute: could not find the planned step's autograd node among its outputs' gradient "
                "functions, to leave the gradients of the outputs it drops unmaterialized. Report this with your "
                "torch version and model")
        keep_missing_gradients(node)


LAYERS_META = "remat_plugin.repeated_layers"  # an exported module's RepeatedLayers, in its .meta
GUARD_META = "remat_plugin.guard"  # the Python values its export read, in its .meta (NOTE [module attributes])
HELD_META = "remat_plugin.held_tensors"  # ids of the tensors the model holds as attributes, when it was exported
_told_whole: set[tuple[str, str]] = set()


def graph_text(gm: torch.fx.GraphModule) -> str:
    """What tells whether two captures exported the same graph (NOTE [module attributes]): the code of ``gm`` and
    of the graphs inside it (a region's: an autocast or no_grad block, whose constants are not in ``gm.code``),
    and with layers traced once, their templates' code, each layer call's id (new at every capture) replaced by
    its template.  ``gm.code`` alone took a value read only inside a region for one the forward does not read,
    and never matched for a layered model, which captured again at every step for a step counter it keeps.  The
    tensors the forward made from Python values (``torch.tensor(self.scale)``, a constant in the default dtype)
    are attributes of the graph, not its code: their dtypes, shapes and contents are in the text too, or a
    changed value read only through one was taken for one not read, and its next change went unseen (found
    2026-11-29).  A tensor the model holds (``self.mask``, NOTE [tensor attributes]) is the very tensor in both
    captures, watched by identity, its contents the caller's to change in place: only its dtype and shape."""
    def code(m: torch.fx.GraphModule) -> str:
        held = m.meta.get(HELD_META, frozenset())
        return "\n".join(sub.code + "".join(_constant_text(name, t, id(t) in held) for name, t in vars(sub).items()
                                            if isinstance(t, torch.Tensor))
                         for sub in m.modules() if isinstance(sub, torch.fx.GraphModule))

    layers = gm.meta.get(LAYERS_META)
    if layers is None:
        return code(gm)
    text, templates = layers.with_templates(code(gm))
    return "\n".join([text, *map(code, templates)])

_unread = itertools.count()  # numbers the constants whose bytes could not be read


def _constant_text(name: str, t: torch.Tensor, held: bool) -> str:
    """A lifted constant as :func:`graph_text` compares it: its dtype, shape and, made by the forward, a digest of
    its bytes."""
    digest = "held by the model"
    if not held:
        try:
            dense = t.detach().to_dense() if t.layout != torch.strided else t.detach()
            data = dense.reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
        except (RuntimeError, TypeError):  # bytes that cannot be read are never taken for the same ones
            digest = f"unread {next(_unread)}"
    return f"\n# {name}: {t.dtype} {t.layout} {tuple(t.shape)} {digest}"


def _warn_traced_whole(model: str, exc: Exception) -> None:
    """Say (once per model and reason) that a model's layers are traced one by one, and why."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    reason = reason.split("NotSpliceable: ")[-1][:300]  # the reason itself, not export's wrapping of it
    if (model, reason) not in _told_whole:
        _told_whole.add((model, reason))
        log.warning("remat_plugin.capture: %s's repeated layers could not be traced once (%s); each layer is traced "
                    "(planning takes longer, the plan is the same)", model, reason)


def _export(module: nn.Module, args: tuple, kwargs: dict,
            options: ExecutionOptions) -> tuple[torch.fx.GraphModule, RepeatedLayers | None]:
    """The exported module, with its repeated layers as opaque ops when they can be (NOTE [layers traced once])."""
    check_hooks(module)
    layers = RepeatedLayers.of(module) if options.layers_once else None
    if layers is not None:
        try:
            with layers.opaque():
                gm = export_module(module, args, kwargs)
            layers.export_templates(export_module)
            gm.meta[LAYERS_META] = layers
            return gm, layers
        except Exception as exc:  # noqa: BLE001 -- any failure of the opaque export: the whole export decides
            gm = export_module(module, args, kwargs)  # its error, if it fails too, is the one to see
            hooked = layers.hooked_module()
            if hooked is not None and "fake tensor" in str(exc).lower():  # what a hook recording a template's value
                # leaves in the exported constants: transformers' recorders of router logits or attentions
                exc = NotSpliceable(f"{hooked} got hooks during the call (as transformers installs its output "
                                    "recorders), which recorded the values of a layer traced once")
            _warn_traced_whole(type(module).__name__, exc)
            return gm, None
    return export_module(module, args, kwargs), None


# NOTE [tensor attributes]
#     A tensor a module holds as a plain attribute (``self.scale = torch.full(...)``, not a registered
#     buffer), or one the forward builds from Python values, is a constant of the exported module, which
#     holds the very tensor.  AOTAutograd traced it as it was, a real tensor among fake ones, and the
#     trace failed ("Please convert all Tensors to FakeTensors first"), so such models fell back.  Each
#     such constant is now an input of the step, like a buffer: the traced graph reads it, and every
#     call passes the tensor itself, so a change made to it in place is seen.  One replaced by another
#     tensor is a changed value of the step's guard (NOTE [module attributes]): the step is built again.
def tensor_constants(gm: torch.fx.GraphModule, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors ``gm``'s graph reads as attributes besides ``named`` (the parameters and buffers), by target."""
    out: dict[str, torch.Tensor] = {}
    held = {id(t) for t in named.values()}  # a tied weight is read under its other name too
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.target not in named and node.target not in out:
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and id(value) not in held:
                out[str(node.target)] = value
                held.add(id(value))
    return out


def build_step(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    emit: Callable[[JointGraph], tuple[torch.fx.GraphModule, torch.fx.GraphModule]],
    device: torch.device,
    dropped_outputs: frozenset[int] = frozenset(),
    options: ExecutionOptions = EAGER,
    ungraded_outputs: frozenset[int] = frozenset(),
    exported: torch.fx.GraphModule | None = None,
    ungrade_beside_the_loss: bool = False,
) -> CompiledStep:
    """Export ``module`` and wrap it so its first call traces the joint graph and calls ``emit``.

    ``emit`` receives the joint graph (where planning happens) and returns the forward and
    backward programs; AOTAutograd calls it as its partitioner.  ``dropped_outputs``: the
    flat tensor outputs the caller drops before backward (NOTE [dropped outputs]); they and
    ``ungraded_outputs`` (held, but reached by no gradient) get no gradient in the backward program
    (NOTE [dropped tangents]).
    ``options``: where the caller runs ``backward()``, and whether the programs are compiled.
    ``exported``: a step's :attr:`CompiledStep.exported` for these very inputs and tensors, traced instead of
    exporting again.
    ``ungrade_beside_the_loss``: also give no gradient to the outputs beside the loss
    (:func:`outputs_beside_the_loss`), decided once the trace has seen the outputs; the batch-size search
    captures this way, planning sizes as a first plan that steps down runs them.
    """
    layers = None
    if exported is not None:
        gm = exported
        layers = gm.meta.get(LAYERS_META)
    else:
        with traced_values(module) as values:  # NOTE [module attributes]
            gm, layers = _export(module, args, kwargs, options)
        put_back = values.left_as_the_forward_left_them()
        if put_back is not None:  # NOTE [values the forward sets]
            with traced_values(module) as again:
                gm_again, layers_again = _export(module, args, kwargs, options)
            if again.wrote_nothing() and graph_text(gm_again) == graph_text(gm):  # not a first-call branch (ActNorm)
                gm, layers, values = gm_again, layers_again, again
            else:
                put_back()
        gm.meta[GUARD_META] = values.guard()
    named: dict[str, torch.Tensor] = dict(module.named_parameters())
    named.update(dict(module.named_buffers()))
    constants = tensor_constants(gm, named)  # NOTE [tensor attributes]
    named.update(constants)
    names = list(named)
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    step = CompiledStep(fn=None, params=list(named.values()), tensor_positions=tensor_positions,  # type: ignore[arg-type]
                        options=options, exported=gm, freed_outputs=dropped_outputs)
    guard = gm.meta.get(GUARD_META)
    if guard is not None:
        step.guard = with_tensors(guard, module, constants)

    def flat_fn(*flat):
        state = dict(zip(names, flat[: len(names)]))
        call_leaves = list(leaves)
        for pos, t in zip(tensor_positions, flat[len(names) :]):
            call_leaves[pos] = t
        call_args, call_kwargs = pytree.tree_unflatten(call_leaves, in_spec)
        out = torch.func.functional_call(step.exported, state, call_args, call_kwargs, strict=False)
        out_leaves, step.out_spec = pytree.tree_flatten(out)
        step.out_tensor_positions = [i for i, x in enumerate(out_leaves) if isinstance(x, torch.Tensor)]
        step.out_constants = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, torch.Tensor)}
        tensors = tuple(x for x in out_leaves if isinstance(x, torch.Tensor))
        step.out_scalars = [i for i, t in enumerate(tensors) if t.numel() == 1 and t.is_floating_point()]
        return tensors

    n_params = len(dict(module.named_parameters()))
    # the precision the caller's autocast casts to with its cache on (NOTE [autocast's cast cache])
    cached_cast = next((dtype for kind, dtype, cache in autocast_settings() if kind == device.type and cache), None)

    def partition_fn(joint_gm, _joint_inputs, *, num_fwd_outputs, **_):
        step.joint_seen = True
        spliced = step.exported.meta.get(LAYERS_META)
        if spliced is not None:
            try:
                spliced.splice(joint_gm, dropped_outputs | ungraded_outputs)  # NOTE [layers traced once]
            except NotSpliceable:
                raise
            except Exception as exc:  # a failed splice retraces whole (said), never a wrong graph
                raise NotSpliceable(f"splicing failed: {type(exc).__name__}: {exc}") from exc
        primals = [n for n in joint_gm.graph.nodes if n.op == "placeholder" and not is_tangent(n)]
        if cached_cast is not None:  # NOTE [autocast's cast cache]
            _, grads, _, _ = extract_fwd_bwd_outputs(joint_gm, num_fwd_outputs=num_fwd_outputs)
            own = cast_by_the_model(step.exported)  # never cached by eager
            weights = [(n, g) for n, g, (name, t) in zip(primals[:n_params], grads, named.items())
                       if t.requires_grad and t.dtype is torch.float32 and name not in own]
            if len(grads) == len(primals) and weights:
                shared = share_parameter_casts(joint_gm, *map(list, zip(*weights)), cached_cast)
                if shared:
                    log.debug("remat_plugin: autocast casts %s once, as its cast cache does", shared)
        split_dropouts(joint_gm)  # NOTE [dropout masks]
        draws_in_memory_order(joint_gm)  # NOTE [draw order]
        beside = outputs_beside_the_loss(len(step.out_tensor_positions), step.out_scalars) \
            if ungrade_beside_the_loss else None
        step.ungraded_outputs = ungraded_outputs | ((beside or frozenset()) - dropped_outputs)
        step.absent_tangents = fold_dropped_tangents(joint_gm, dropped_outputs | step.ungraded_outputs)  # NOTE [dropped tangents]
        if not options.compile:
            step.relaid_tangents = relaid_tangents(joint_gm)  # NOTE [relaid tangents]
        step.partial_gradients = some_gradient_reads_part_of_the_tangents(joint_gm)  # NOTE [gradients no tangent reaches]
        joint = JointGraph(joint_gm, num_fwd_outputs, device.type, dropped_outputs=dropped_outputs,
                           absent_tangents=step.absent_tangents)
        if not options.compile:  # the backward program's adds written into an operand (NOTE [in-place sums in the plan])
            joint.sums_in_place = sums_in_place(joint_gm)
        joint.buffer_primals = {n.name for n in primals[n_params : len(names)]}
        joint.state_primals = {n.name for n in primals[: len(names)]}
        flat_inputs = [*named.values(), *(leaves[i] for i in tensor_positions)]
        joint.grad_primals = {n.name for n, t in zip(primals, flat_inputs) if t.requires_grad}
        joint.real_inputs = {n.name: t for n, t in zip(primals, flat_inputs)}
        return emit(joint)

    def backward_program(gm_, example):
        if options.compile:
            program = boxed(gm_, example)
        else:
            add_in_place(gm_)  # NOTE [in-place adds]
            views_copied_if_needed(gm_)  # NOTE [views of mistraced strides]
            program = step.backward = SegmentedBackward(gm_, options.backward_segments)
            step.programs.append(step.backward)
        if step.absent_tangents or step.relaid_tangents or step.partial_gradients:
            return FilledTangents(program, gm_, step.absent_tangents, step.relaid_tangents)
        return program

    def boxed(gm_, _example):
        if options.compile:
            program: Callable = compile_program(gm_)
        else:
            # Boxed calling convention: the program receives the argument list and clears it,
            # so each saved tensor dies after its last use instead of at the end of backward.
            add_in_place(gm_)  # NOTE [in-place adds]
            views_copied_if_needed(gm_)  # NOTE [views of mistraced strides]
            gm_.graph.set_codegen(BoxedCodeGen())
            gm_.recompile()
            unrun = _unrun_outputs(gm_)

            def program(args: list):
                if step.planning_only and unrun is not None:  # NOTE [planning runs]
                    outs = unrun(args)
                    if outs is not None:
                        args.clear()
                        return outs
                return gm_(args)

            program._boxed_call = True  # type: ignore[attr-defined]
        step.programs.append(program)
        return program

    def traced() -> Callable:
        # enable_log=False: AOTAutograd would otherwise print the whole joint and fw/bw graphs to strings for its
        # structured log at every capture (0.3-0.7 s on a 4-16-layer Llama), whether or not anyone reads the log.
        return aot_function(flat_fn, fw_compiler=boxed, bw_compiler=backward_program, partition_fn=partition_fn,
                            enable_log=False)

    def traced_whole() -> Callable:
        """The step traced with every layer (a model whose layers turned out not to splice)."""
        whole, layered = export_module(module, args, kwargs), step.exported
        assert layered is not None
        whole.meta[GUARD_META] = layered.meta.get(GUARD_META)  # the same forward's values, for a re-plan's reuse
        step.exported = whole
        return traced()

    step.fn = traced()
    step.model_name = type(module).__name__
    if layers is not None:
        step.traced_whole = traced_whole
    return step
