"""Trace a model's repeated layers once: each layer is one opaque op while the model is traced, and the
joint graph of one layer is spliced in at every call.

NOTE [layers traced once]
    ``torch.export`` and AOTAutograd trace every op of every layer, so capture grows with depth
    (0.35 s a llama-tiny layer on this CPU), while the layers are copies of one another.  Here each
    layer of the model's largest list of repeated layers (:func:`find_layer_chain`) runs, while the
    model is exported and traced, as one custom op ``remat_plugin::layer`` whose autograd formula is
    a second op ``remat_plugin::layer_grad``: the model's joint graph holds two nodes per layer call.
    One layer of each kind is exported alone (:meth:`RepeatedLayers.export_templates`), and
    :meth:`RepeatedLayers.splice`, given the model's joint graph, traces that layer's joint graph on
    fake tensors of the model's own fake mode and replaces every call's two nodes by a copy of it
    (:mod:`remat_plugin.capture.layer_splice`),
    reading the call's own parameters and inputs.  The result is the joint graph a whole-model trace
    gives, node for node (``tests/test_repeated_layers.py`` compares them), and planning goes on from
    it unchanged; the two ops never run.  Each copy's values get fake storages of their own: copies
    sharing one would tell inductor that layer 1's values alias layer 0's.

    Soundness rests on two checks.  Layers are "of one kind" when their forward, run once each on fake
    tensors under a dispatch mode, issues the same ops with the same constants on the same (parameter,
    input, earlier op) operands, on inputs of the same sizes, types and ``requires_grad``: AOTAutograd's
    joint graph is a function of exactly that.  A layer whose forward differs (a per-layer scale, a
    sliding window on every other layer) gets a template of its own.  Second, gradients of a value a
    layer differentiates that something besides that one layer call also reads (an encoder output
    read by every decoder layer, a hidden state also returned, a parameter two calls share) would be
    summed in another order than a whole-model trace sums them; such a model is traced whole
    (:class:`NotSpliceable`, said once as a warning), as are models with hooks (also hooks installed
    during the traced call, as transformers' recorders of router logits are) or buffers in their
    layers, layers called with non-tensor arguments other than plain constants, and steps that
    differentiate nothing.  Under autocast the templates are traced under the caller's autocast, as the
    model is (``tests/test_repeated_layers.py`` compares bf16 autocast traces too).
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
from torch import Tensor, fx, nn

from remat_plugin.capture.forward_swap import swapped_forwards
from remat_plugin.capture.layer_splice import LayerJoint, NotSpliceable, splice_call
from remat_plugin.torch_private import (
    FakeTensor,
    PlainAOTOutput,
    TorchDispatchMode,
    aot_function,
    autocast_as,
    autocast_settings,
    forward_hooks_off,
    module_hooks,
    pytree,
    tangent_output,
    unbacked_reads_ignored,
)

log = logging.getLogger(__name__)


def _repeated_lists(module: nn.Module) -> Iterator[tuple[str, list[nn.Module]]]:
    """Every ``ModuleList``/``Sequential`` of two or more modules of one class, parents before children."""
    for name, child in module.named_modules():
        if isinstance(child, (nn.ModuleList, nn.Sequential)) and len(child) >= 2 and len({type(m) for m in child}) == 1:
            yield name, list(child)


def find_layer_chain(module: nn.Module) -> tuple[str, list[nn.Module]] | None:
    """The repeated layers holding the most parameters: ``(qualified name, layers)``, or None."""
    best: tuple[int, str, list[nn.Module]] | None = None
    for name, layers in _repeated_lists(module):
        n_params = sum(p.numel() for m in layers for p in m.parameters())
        if best is None or n_params > best[0]:
            best = (n_params, name, layers)
    return None if best is None else (best[1], best[2])


def find_layer_chains(module: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """:func:`find_layer_chain`'s layers first, then every other list of repeated layers outside them that holds
    none of them (a vision tower beside a language model, an encoder beside a decoder): the per-layer fallback
    checkpoints them all.  Lists of bare modules (a head's two Linears) are not layers: checkpointing one
    saves nothing, as its output is not what its backward reads."""
    best = find_layer_chain(module)
    if best is None:
        return []
    chains = [best]

    def nested(inner: str, outer: str) -> bool:
        return outer == "" or inner == outer or inner.startswith(outer + ".")

    for name, layers in _repeated_lists(module):  # parents first: the outermost list of a kind wins
        if any(True for _ in layers[0].children()) and \
                not any(nested(name, other) or nested(other, name) for other, _ in chains):
            chains.append((name, layers))
    return chains


_LEAF = object()  # stands for a tensor leaf among a call's non-tensor constants


def _hooked(module: nn.Module) -> bool:
    return bool(module_hooks(module, backward=False) or module_hooks(module, backward=True))


@dataclass
class _Call:
    """One layer call as the model's trace met it."""

    owner: RepeatedLayers
    layer: int  # index into owner.layers
    spec: Any  # pytree spec of (args, kwargs)
    constants: tuple  # the leaves, _LEAF where a tensor goes
    requires_grad: tuple[bool, ...]  # of the tensor inputs
    out_spec: Any = None
    out_metas: list[tuple] | None = None  # (shape, stride, dtype, device) of each tensor output
    out_constants: dict[int, Any] = field(default_factory=dict)  # non-tensor output leaves by flat position
    n_out: int = 0
    kind: int | None = None  # index into owner.templates, once fingerprinted
    # Autocast where the layer was called (the caller's, or a region of the model's own): its fingerprint and its
    # template are traced under it, since the op's fake kernel and AOTAutograd's partitioner run with autocast off.
    autocast: tuple = ()
    example: list[tuple] | None = None  # (shape, stride, dtype, device) of each input, for the template's export


# Calls by id, as the two ops name them; each is held by its RepeatedLayers, which the exported module holds.
_CALLS: weakref.WeakValueDictionary[int, _Call] = weakref.WeakValueDictionary()
# Non-tensor arguments a layer call may carry into the opaque op: anything else (a cache object the layer
# updates, a callable) could make the layer's behaviour differ from the template's without showing in its ops.
_PLAIN_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout, torch.memory_format)
_call_ids = itertools.count()


class _OwnForward(threading.local):
    """How deep this thread is in a layer's own forward (a fingerprint, a template's export): layers called there
    run as written, not as the opaque op.  Per thread, so a model exported meanwhile on another thread still gets
    opaque layers."""

    depth = 0


_own_forward = _OwnForward()


@contextlib.contextmanager
def _running_own_forward() -> Iterator[None]:
    _own_forward.depth += 1
    try:
        yield
    finally:
        _own_forward.depth -= 1


def _unflatten_inputs(call: _Call, inputs: list[Tensor]) -> tuple[tuple, dict]:
    it = iter(inputs)
    leaves = [next(it) if c is _LEAF else c for c in call.constants]
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    return args, kwargs


def _leaves(out: Any) -> list:
    """An op's outputs in pytree's leaf order (lists and tuples, nested)."""
    if isinstance(out, (list, tuple)):
        return [leaf for x in out for leaf in _leaves(x)]
    return [out]


class _Fingerprint(TorchDispatchMode):
    """Every op a layer's forward issues, with its constants and where each tensor operand came from."""

    def __init__(self, known: dict[int, tuple]):
        super().__init__()
        self.known = known
        self.ops: list[tuple] = []
        self.alive: list[Tensor] = []  # keeps ids unique while recording

    def _describe(self, a):
        # By hand rather than with pytree: an op's operands are tensors, constants and lists of them, and this
        # runs for every op of every layer (pytree was most of a fingerprint's own time).
        if isinstance(a, Tensor):
            return self.known.get(id(a), ("const", id(a)))
        if isinstance(a, (list, tuple)):
            return type(a).__name__, tuple(self._describe(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, self._describe(v)) for k, v in a.items())
        return repr(a)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        i = len(self.ops)
        self.ops.append((str(func), self._describe(args), self._describe(kwargs)))
        for j, t in enumerate(_leaves(out)):
            if isinstance(t, Tensor):
                self.known[id(t)] = ("op", i, j)
                self.alive.append(t)
        return out


@torch.library.custom_op("remat_plugin::layer", mutates_args=())
def _layer_op(call_id: int, params: list[Tensor], inputs: list[Tensor]) -> list[Tensor]:
    raise NotSpliceable("remat_plugin: a traced-once layer ran unspliced (NOTE [layers traced once]); report this")


@_layer_op.register_fake
def _layer_fake(call_id, params, inputs):
    call = _CALLS[call_id]
    if call.out_metas is None:
        call.owner.fingerprint(call, params, inputs)
    assert call.out_metas is not None
    return [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in call.out_metas]


@torch.library.custom_op("remat_plugin::layer_grad", mutates_args=())
def _layer_grad_op(call_id: int, params: list[Tensor], inputs: list[Tensor],
                   grads: list[Optional[Tensor]]) -> list[Tensor]:  # noqa: UP045 -- custom_op reads the annotation
    raise NotSpliceable("remat_plugin: a traced-once layer ran unspliced (NOTE [layers traced once]); report this")


def _wanted_grads(call: _Call) -> list[bool]:
    owner = call.owner
    return [*owner.param_requires_grad, *call.requires_grad]


@_layer_grad_op.register_fake
def _layer_grad_fake(call_id, params, inputs, grads):
    call = _CALLS[call_id]
    return [torch.empty_like(t) for t, w in zip([*params, *inputs], _wanted_grads(call)) if w]


def _setup(ctx, inputs, output):
    call_id, params, ins = inputs
    ctx.call_id = call_id
    ctx.n_params = len(params)
    ctx.save_for_backward(*params, *ins)


def _backward(ctx, grads):
    saved = ctx.saved_tensors
    params, ins = list(saved[: ctx.n_params]), list(saved[ctx.n_params :])
    made = iter(torch.ops.remat_plugin.layer_grad(ctx.call_id, params, ins, list(grads)))
    out = [next(made) if w else None for w in _wanted_grads(_CALLS[ctx.call_id])]
    return None, out[: ctx.n_params], out[ctx.n_params :]


_layer_op.register_autograd(_backward, setup_context=_setup)


@dataclass
class _Template:
    """One kind of layer: its fingerprint, and once traced, its joint graph."""

    fingerprint: tuple
    first: _Call
    exported: fx.GraphModule | None = None  # the layer alone, exported
    joint: LayerJoint | None = None  # its joint graph, once traced


def _returned_with_gradient(graph: fx.Graph, ungraded_outputs: frozenset[int]) -> dict[fx.Node, int]:
    """The forward values the joint graph returns as flat outputs whose gradient (tangent) it adds, by node: the
    outputs that have a tangent, less ``ungraded_outputs``.  Every returned value where the graph does not say.

    NOTE [returned layer inputs]
        A layer's input that the model also returns (transformers' ``output_hidden_states``, a model's list of
        its layers' outputs for deep supervision) gets its gradient from the caller as well as from the layer.
        Eager autograd adds the caller's first, as it arrives before the layer's backward runs, then the
        layer's contributions one by one; a spliced layer sums its own contributions inside and the caller's
        after, which rounds otherwise (a 4-layer float64 model with a loss on layer 1's output: 5.6e-17 on
        every step, found 2026-11-27).  Such a call is traced whole, and so are the later plans of it, which
        trace its whole export again (a later plan that gives the output no gradient could splice: not done)."""
    out = graph.output_node()
    values = cast(list, out.args[0])
    descs = out.meta.get("desc")
    if not isinstance(descs, (list, tuple)) or len(descs) != len(values):
        return {v: i for i, v in enumerate(values) if isinstance(v, fx.Node)}
    with_tangent = {tangent_output(ph) for ph in graph.find_nodes(op="placeholder")}
    return {v: d.idx for v, d in zip(values, descs) if isinstance(v, fx.Node) and isinstance(d, PlainAOTOutput)
            and d.idx in with_tangent and d.idx not in ungraded_outputs}


class _Captured(Exception):
    """Ends a template trace once AOTAutograd has handed over the joint graph."""


class RepeatedLayers:
    """The layers of one model traced once per kind (NOTE [layers traced once])."""

    def __init__(self, layers: list[nn.Module]):
        self.layers = layers
        first = layers[0]
        self.param_names = [n for n, _ in first.named_parameters()]
        self.param_requires_grad = [p.requires_grad for _, p in first.named_parameters()]
        self.templates: list[_Template] = []
        self.calls: list[_Call] = []

    @staticmethod
    def of(module: nn.Module, min_layers: int = 2) -> RepeatedLayers | None:
        """The repeated layers of ``module`` when they can be traced once, else None (traced whole)."""
        found = find_layer_chain(module)
        if found is None or len(found[1]) < min_layers:
            return None
        layers = found[1]
        first = layers[0]
        shape = [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in first.named_parameters()]
        for index, layer in enumerate(layers):
            why = None
            if [(n, p.shape, p.dtype, p.device, p.requires_grad) for n, p in layer.named_parameters()] != shape:
                why = "its parameters differ from layer 0's"
            elif any(True for _ in layer.buffers()):
                why = "it holds buffers, whose updates the opaque op would hide"
            elif any(isinstance(v, Tensor) for m in layer.modules() for v in vars(m).values()):
                why = "it holds tensors as plain attributes, which the model's trace takes as inputs (NOTE [tensor " \
                      "attributes] in remat_plugin.capture.export)"
            elif any(_hooked(m) for m in layer.modules()):
                why = "it has hooks, which run once in a traced template"
            if why is not None:
                log.debug("remat_plugin.capture: %s's layers are traced one by one: layer %d of %s %s",
                          type(module).__name__, index, found[0], why)
                return None
        return RepeatedLayers(layers)

    def hooked_module(self) -> str | None:
        """A module inside a layer that has hooks now (``"layer 0's self_attn"``), though :meth:`of` found none: hooks
        installed by the traced call itself, as transformers installs its output recorders."""
        for index, layer in enumerate(self.layers):
            name = next((name for name, m in layer.named_modules() if name and _hooked(m)), None)
            if name is not None:
                return f"layer {index}'s {name}"
        return None

    def opaque(self) -> contextlib.AbstractContextManager[None]:
        """Inside, each layer's forward is one ``remat_plugin::layer`` op (for ``torch.export``)."""
        return swapped_forwards(self.layers, self._opaque_forward)

    def _opaque_forward(self, layer: nn.Module, original: Callable) -> Callable:
        owner, index = self, self.layers.index(layer)

        def forward(*args, **kwargs):
            if _own_forward.depth:
                return original(*args, **kwargs)
            leaves, spec = pytree.tree_flatten((args, kwargs))
            odd = [x for x in leaves if not isinstance(x, (Tensor, *_PLAIN_CONSTANTS))]
            if odd:
                raise NotSpliceable(f"layer {index} is called with a {type(odd[0]).__name__}, which its traced "
                                    "template could not stand for")
            tensors = [x for x in leaves if isinstance(x, Tensor)]
            call = _Call(owner, index, spec, tuple(_LEAF if isinstance(x, Tensor) else x for x in leaves),
                         tuple(t.requires_grad for t in tensors), autocast=autocast_settings())
            call_id = next(_call_ids)
            _CALLS[call_id] = call
            owner.calls.append(call)
            params = [p for _, p in owner.layers[index].named_parameters()]
            outs = torch.ops.remat_plugin.layer(call_id, params, tensors)
            it = iter(outs)
            out_leaves = [call.out_constants[i] if i in call.out_constants else next(it) for i in range(call.n_out)]
            return pytree.tree_unflatten(out_leaves, call.out_spec)

        return forward

    def fingerprint(self, call: _Call, params: list[Tensor], inputs: list[Tensor]) -> None:
        """Run the call's own layer on fake tensors: its outputs' metadata, and which template it takes."""
        known: dict[int, tuple] = {id(p): ("param", i) for i, p in enumerate(params)}
        known.update({id(t): ("input", i) for i, t in enumerate(inputs)})
        args, kwargs = _unflatten_inputs(call, inputs)
        names = self.param_names
        # The op stands for the layer's forward: its call's hooks ran around the op (run again here, transformers'
        # output_hidden_states recorder kept this run's fake output, foreign to the model's export, and the layers
        # could not be traced once).
        with _running_own_forward(), autocast_as(call.autocast), _Fingerprint(known) as recorder, \
                unbacked_reads_ignored([*params, *inputs]), forward_hooks_off(self.layers[call.layer]):
            out = torch.func.functional_call(self.layers[call.layer], dict(zip(names, params)), args, kwargs,
                                             strict=True)
        out_leaves, call.out_spec = pytree.tree_flatten(out)
        call.n_out = len(out_leaves)
        call.out_constants = {i: x for i, x in enumerate(out_leaves) if not isinstance(x, Tensor)}
        outs = [x for x in out_leaves if isinstance(x, Tensor)]
        if any(id(t) in known and known[id(t)][0] != "op" for t in outs):
            raise NotSpliceable(f"layer {call.layer} returns one of its inputs or parameters")
        call.out_metas = [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in outs]
        meta = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device)) for t in [*params, *inputs])
        key = (tuple(recorder.ops), meta, call.requires_grad, repr(call.spec), repr(call.constants), call.autocast)
        for kind, template in enumerate(self.templates):
            if template.fingerprint == key:
                call.kind = kind
                return
        call.kind = len(self.templates)
        call.example = [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in inputs]
        self.templates.append(_Template(key, call))

    def with_templates(self, code: str) -> tuple[str, list[fx.GraphModule]]:
        """``code`` (the model's, exported with these layers opaque) with each layer call's id, new at every
        capture, replaced by the template the call takes; and the templates' exported modules, whose code holds
        what the layers compute: together, what tells two captures' graphs apart (NOTE [module attributes])."""
        def template(found: re.Match) -> str:
            call = _CALLS.get(int(found.group(1)))
            return f"remat_plugin.layer.default(template_{call.kind if call is not None else '?'},"

        return (re.sub(r"remat_plugin\.layer\.default\((\d+),", template, code),
                [t.exported for t in self.templates if t.exported is not None])

    def export_templates(self, export_module: Callable[[nn.Module, tuple, dict], fx.GraphModule]) -> None:
        """Export (with ``export_module``) one layer of each kind alone; :meth:`splice` traces its joint graph."""
        for template in self.templates:
            if template.exported is None:
                call = template.first
                assert call.example is not None
                inputs = [torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_().requires_grad_(grad)
                          for (shape, stride, dtype, device), grad in zip(call.example, call.requires_grad)]
                args, kwargs = _unflatten_inputs(call, inputs)
                with _running_own_forward(), autocast_as(call.autocast):
                    template.exported = export_module(self.layers[call.layer], args, kwargs)

    def _trace(self, template: _Template, params: list[Tensor], inputs: list[Tensor], mode: Any) -> None:
        """The template's joint graph, traced on ``params`` and ``inputs``: fake tensors of the model's trace, so the
        spliced nodes' metadata and the model's share one fake mode (inductor asserts they do)."""
        gm, call, names = template.exported, template.first, self.param_names
        assert gm is not None
        got: dict[str, Any] = {}

        def flat_fn(*flat):
            state = dict(zip(names, flat[: len(names)]))
            call_args, call_kwargs = _unflatten_inputs(call, list(flat[len(names) :]))
            out = torch.func.functional_call(gm, state, call_args, call_kwargs, strict=False)
            return tuple(x for x in pytree.tree_leaves(out) if isinstance(x, Tensor))

        def capture(joint_gm, _joint_inputs, *, num_fwd_outputs, **_):
            got["joint"], got["n"] = joint_gm, num_fwd_outputs
            raise _Captured

        traced = aot_function(flat_fn, fw_compiler=lambda g, _e: g, partition_fn=capture, enable_log=False)
        try:
            with torch.enable_grad(), autocast_as(call.autocast):  # AOTAutograd partitions under no_grad
                traced(*params, *inputs)
        except _Captured:
            pass
        if "joint" not in got:
            raise NotSpliceable(f"layer {call.layer} has nothing to differentiate")
        template.joint = LayerJoint(got["joint"], got["n"], mode)

    def _traced_for(self, graph: fx.Graph, fwd_nodes: list[fx.Node]) -> None:
        """Trace each template the calls in ``fwd_nodes`` take, in the fake mode of ``graph``'s own metadata."""
        vals = [n.meta.get("val") for n in graph.find_nodes(op="placeholder")]
        mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
        for node in fwd_nodes:
            call = _CALLS[cast(int, node.args[0])]
            template = self.templates[cast(int, call.kind)]
            if template.joint is not None and template.joint.mode is mode:
                continue
            examples = [cast(fx.Node, a).meta["val"] for a in [*cast(list, node.args[1]), *cast(list, node.args[2])]]
            with mode if mode is not None else contextlib.nullcontext():
                flat = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in examples]
            for t, grad in zip(flat, _wanted_grads(call)):
                t.requires_grad_(grad)
            self._trace(template, flat[: len(self.param_names)], flat[len(self.param_names) :], mode)

    def splice(self, joint_gm: fx.GraphModule, ungraded_outputs: frozenset[int] = frozenset()) -> None:
        """Replace every layer call's two nodes in ``joint_gm`` by its template's forward and backward.

        ``ungraded_outputs``: the flat outputs no gradient will reach (their tangents folded away, NOTE [dropped
        tangents]).  Raises :class:`NotSpliceable` (before changing the graph) where the result would not be the
        joint graph a whole-model trace gives."""
        graph = joint_gm.graph
        layer_op, grad_op = torch.ops.remat_plugin.layer.default, torch.ops.remat_plugin.layer_grad.default
        fwd_nodes = list(graph.find_nodes(op="call_function", target=layer_op))
        grad_nodes = {cast(int, n.args[0]): n for n in graph.find_nodes(op="call_function", target=grad_op)}
        returned = _returned_with_gradient(graph, ungraded_outputs)
        for node in fwd_nodes:
            call = _CALLS[cast(int, node.args[0])]
            if cast(int, node.args[0]) not in grad_nodes:
                raise NotSpliceable(f"layer {call.layer} was called without a backward")
            operands = [*cast(list, node.args[1]), *cast(list, node.args[2])]
            for arg, grad in zip(operands, _wanted_grads(call)):
                readers = [u for u in arg.users if u is not node and u.meta.get("partitioner_tag") == "is_forward"
                           and u.target is not torch.ops.aten.detach.default]  # saved for a backward: no gradient
                if grad and (readers or operands.count(arg) > 1):
                    where = readers[0].name if readers else "this layer twice"
                    raise NotSpliceable(f"{arg.name}, which layer {call.layer} differentiates, is also read by {where}; "
                                        "its gradients would be summed in another order")
                if grad and arg in returned:
                    raise NotSpliceable(f"layer {call.layer}'s input {arg.name} is also returned as output "
                                        f"{returned[arg]}, which may get a gradient (NOTE [returned layer inputs]); "
                                        "its gradients would be summed in another order")
        self._traced_for(graph, fwd_nodes)
        for node in fwd_nodes:
            call_id = cast(int, node.args[0])
            call = _CALLS[call_id]
            template = self.templates[cast(int, call.kind)]
            assert template.joint is not None
            splice_call(graph, node, grad_nodes[call_id], template.joint, _wanted_grads(call), call.layer,
                        f"_remat_layer_{id(template)}")
        # No recompile: nothing runs the joint module's code, and the passes after this one regenerate it.
