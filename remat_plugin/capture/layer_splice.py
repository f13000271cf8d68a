"""Splice one traced layer's joint graph into the model's joint graph at a layer call (NOTE [layers traced once]
in :mod:`remat_plugin.capture.repeated_layers`).

A layer call is two nodes of the model's joint graph: ``remat_plugin::layer`` in the forward and
``remat_plugin::layer_grad`` in the backward.  :func:`splice_call` replaces them by a copy of the layer's
joint graph (:class:`LayerJoint`) reading the call's own parameters, inputs and output gradients.  Each
copy's values get fake storages of their own (:class:`_FreshMetas`).
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any, cast

from torch import Tensor, fx

from remat_plugin.errors import RematError
from remat_plugin.torch_private import (
    FakeTensor,
    fake_on_storage,
    is_primal,
    is_tangent,
    tangent_output,
)


class NotSpliceable(RematError):
    """The model's layers cannot be traced once and spliced; it is traced whole instead."""


@dataclass
class LayerJoint:
    """One layer's joint graph, traced in the fake mode ``mode`` of the model's trace."""

    gm: fx.GraphModule
    num_fwd_outputs: int
    mode: Any

    @functools.cached_property
    def parts(self) -> tuple[list[fx.Node], list[fx.Node], list[fx.Node], list[Any]]:
        """The joint graph's nodes, its primals, its tangents and its outputs."""
        nodes = list(self.gm.graph.nodes)
        output = next(n for n in nodes if n.op == "output")
        return (nodes, [n for n in nodes if is_primal(n)], [n for n in nodes if is_tangent(n)],
                list(cast(tuple, output.args[0])))


def splice_call(graph: fx.Graph, fwd_node: fx.Node, grad_node: fx.Node, joint: LayerJoint, wanted_grads: list[bool],
                layer: int, attr_prefix: str) -> None:
    """Replace one layer call's two nodes in ``graph`` by a copy of ``joint``.

    ``wanted_grads``: which of the call's parameters and inputs the model's trace takes a gradient of;
    ``layer``: the layer's index, for messages; ``attr_prefix``: names the template's constants in the joint
    module (one prefix per template, so calls of one template share them)."""
    fresh = _FreshMetas(joint.mode)
    env = _splice_forward(graph, fwd_node, joint, fresh, attr_prefix)
    _splice_backward(graph, grad_node, joint, env, fresh, wanted_grads, layer)


class _FreshMetas:
    """Fake tensors of one spliced call, each on storage of its own (the template's storage for storage): copies of
    one template node must not share a fake storage, or inductor would take layer 1's value for a view of layer 0's.
    A template input's storage is the model's operand's, so views of a layer's inputs stay views of them."""

    def __init__(self, mode: Any):
        self.mode = mode
        self.storages: dict[int, Any] = {}  # template storage (_cdata) -> the storage that stands for it here

    def seed(self, template_val: Any, val: Any) -> None:
        if isinstance(template_val, Tensor) and isinstance(val, Tensor):
            self.storages[template_val.untyped_storage()._cdata] = val.untyped_storage()

    def __call__(self, val: Any) -> Any:
        if isinstance(val, (list, tuple)):
            return type(val)(self(v) for v in val)
        if not isinstance(val, FakeTensor):
            return val
        key = val.untyped_storage()._cdata
        made = fake_on_storage(self.mode, self.storages.get(key), val)
        self.storages.setdefault(key, made.untyped_storage())
        return made


def _splice_forward(graph: fx.Graph, node: fx.Node, joint: LayerJoint, fresh: _FreshMetas,
                    attr_prefix: str) -> dict[fx.Node, Any]:
    nodes, primals, _, outs = joint.parts
    env: dict[fx.Node, Any] = dict(zip(primals, [*cast(list, node.args[1]), *cast(list, node.args[2])]))
    for primal, operand in zip(primals, env.values()):
        fresh.seed(primal.meta.get("val"), operand.meta.get("val"))
    owner = graph.owning_module
    with graph.inserting_before(node):
        for n in nodes:
            if n.op == "get_attr":  # a constant of the template: the joint module gets it too
                name = f"{attr_prefix}_{n.target}".replace(".", "_")
                if not hasattr(owner, name):
                    setattr(owner, name, getattr(joint.gm, cast(str, n.target)))
                env[n] = graph.create_node("get_attr", name)  # as make_fx adds its constants: graph.get_attr warns
                env[n].meta = dict(n.meta)
            elif n.op == "call_function" and n.meta.get("partitioner_tag") == "is_forward":
                env[n] = graph.node_copy(n, lambda a: env[a])
                env[n].meta["val"] = fresh(n.meta.get("val"))
    for user in list(node.users):
        user.replace_all_uses_with(env[outs[_output_index(user)]])
        graph.erase_node(user)
    graph.erase_node(node)
    return env


def _splice_backward(graph: fx.Graph, node: fx.Node, joint: LayerJoint, env: dict[fx.Node, Any], fresh: _FreshMetas,
                     wanted_grads: list[bool], layer: int) -> None:
    nodes, _, tangents, outs = joint.parts
    grads_in = cast(list, node.args[3])
    for tangent in tangents:  # each the gradient of one of the layer's outputs
        index = tangent_output(tangent)
        if index is None:
            raise NotSpliceable(f"layer {layer}'s template has a tangent of no plain output "
                                f"({tangent.meta.get('desc')!r})")
        if grads_in[index] is None:
            raise NotSpliceable(f"output {index} of layer {layer} has no gradient")
        env[tangent] = grads_in[index]
        fresh.seed(tangent.meta.get("val"), env[tangent].meta.get("val"))
    with graph.inserting_before(node):
        for n in nodes:
            if n.op == "call_function" and n not in env:
                env[n] = graph.node_copy(n, lambda a: env[a])
                env[n].meta["val"] = fresh(n.meta.get("val"))
    grads = outs[joint.num_fwd_outputs :]  # one per primal: the parameters', then the inputs'
    made = [env[g] if isinstance(g, fx.Node) else None for g, w in zip(grads, wanted_grads) if w]
    for user in list(node.users):
        value = made[_output_index(user)]
        if value is None:
            raise NotSpliceable(f"layer {layer}'s template makes no gradient where the model's trace wants one")
        user.replace_all_uses_with(value)
        graph.erase_node(user)
    graph.erase_node(node)


def _output_index(user: fx.Node) -> int:
    """Which output of a layer op ``user`` reads."""
    if user.target is not operator.getitem:
        raise NotSpliceable(f"a layer op's output is read whole by {user.name}")
    return int(user.args[1])  # type: ignore[arg-type]
