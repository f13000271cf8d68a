"""What an exported forward does besides computing its outputs, that a planned step must restore or refuse.

- It writes into tensors it is given (NOTE [inputs written by the forward]): the runs that plan or meter a step
  restore them.
- It writes into a parameter in place, or draws from a generator passed to an op: no planned step can replay
  that (:func:`refuse_unreplayable_effects`).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from remat_plugin.capture.tensor_checks import traced_line
from remat_plugin.errors import CaptureError
from remat_plugin.torch_private import OpOverload

MUTATED_INPUTS_META = "remat_plugin.mutated_inputs"  # flat positions of the call's tensors the forward writes into


# NOTE [inputs written by the forward]
#     A forward may write into a tensor it is given (``mask.mul_(2)``).  Runs made only to plan or to meter
#     the step (NOTE [calibration]) restore buffers and the RNG, but did not restore such an input: the caller's
#     first step ran on an input the metered run had already written into (a mask doubled twice, the loss and
#     gradients not eager's).  Export keeps those writes as in-place ops on the input's placeholder (or a view of
#     it); their flat positions in the call are kept with the exported module, and those runs restore them.
def mutated_inputs(exported: torch.export.ExportedProgram) -> frozenset[int]:
    """Flat positions, among the call's arguments, of the tensors the exported forward writes into."""
    user = [spec.arg.name for spec in exported.graph_signature.input_specs if spec.kind.name == "USER_INPUT"]
    position = {name: i for i, name in enumerate(user)}
    found: set[int] = set()
    for _, written in _written_args(exported.graph):
        value = _aliased(written)  # through views to the tensor they look at
        if value.op == "placeholder" and value.name in position:
            found.add(position[value.name])
    return frozenset(found)


def _written_args(graph: torch.fx.Graph) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(op, argument)`` for each tensor argument an op of ``graph`` writes into (by its schema)."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, OpOverload):
            continue
        for arg, value in zip(target._schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.fx.Node):
                yield node, value


def _refuse_own_generators(gm: torch.fx.GraphModule, model: str) -> None:
    """A forward drawing from a ``torch.Generator`` it passes to an op (``generator=``) is refused, with no fallback.

    The plan replays a recomputed random op's draws from the default generators' saved states (NOTE [random
    ops]); a generator of the model's own would draw anew in a recomputation, and the runs that plan and meter a
    step would advance it: other noise than eager's, silently.  ``torch.utils.checkpoint`` restores only the
    default generators too, so per-layer checkpointing is no way out.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.kwargs.get("generator") is not None:
            line = traced_line(node)
            raise CaptureError(
                f"remat_plugin.capture: {model}'s forward draws from a torch.Generator passed to the op "
                f"({node.target}{' at ' + line if line else ''}): a recomputation would draw from it again, the runs "
                "that plan and meter a step would advance it, and export holds a copy of torch.default_generator "
                "rather than it, so the noise would not be eager's. Pass no generator=: draw from the default "
                "generator (seeded with torch.manual_seed), whose draws the plan replays", fallback=False)


def _refuse_parameter_updates(gm: torch.fx.GraphModule, model: str) -> None:
    """A forward that writes into a parameter in place (``nn.Embedding(max_norm=...)`` renormalizes the rows it looks
    up through a detached alias; weight clipping under ``torch.no_grad()``) cannot run as a traced step: AOTAutograd
    writes the update back into the parameter where autograd forbids it, and the step failed with autograd's bare "a
    leaf Variable that requires grad is being used in an in-place operation".  It is refused at capture, naming the
    op and the model's line."""
    for node, base in _written_bases(gm, gm.graph, {}):
        if base.op != "get_attr":
            continue
        value: Any = gm
        for part in str(base.target).split("."):
            value = getattr(value, part, None)
        if isinstance(value, nn.Parameter) and value.requires_grad:
            line = traced_line(node)
            raise CaptureError(
                f"remat_plugin.capture: {model}'s forward writes into its parameter {base.target} in place "
                f"({node.target}{' at ' + line if line else ''}; nn.Embedding(max_norm=...) and weight clipping do "
                "so), which a planned step cannot replay: update the weight outside the forward (under "
                "torch.no_grad(), before the step; build an nn.Embedding without max_norm)")


def _written_bases(gm: torch.fx.GraphModule, graph: torch.fx.Graph,
                   outer: dict[torch.fx.Node, torch.fx.Node]) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """``(op, tensor it writes into)`` through views, also inside the regions export wraps in a higher-order op with
    their own graph (a ``torch.no_grad()`` block: ``wrap_with_set_grad_enabled``), whose placeholders ``outer`` maps
    to the operands outside."""
    for node, written in _written_args(graph):
        base = _aliased(written)
        while base in outer:
            base = _aliased(outer[base])
        yield node, base
    for node in graph.nodes:
        if node.op != "call_function" or isinstance(node.target, OpOverload):
            continue
        at = next((i for i, a in enumerate(node.args) if isinstance(a, torch.fx.Node) and a.op == "get_attr"
                   and isinstance(getattr(gm, str(a.target), None), torch.fx.GraphModule)), None)
        if at is None:
            continue
        region = getattr(gm, str(node.args[at].target))
        placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
        inner = {p: a for p, a in zip(placeholders, node.args[at + 1:]) if isinstance(a, torch.fx.Node)}
        yield from _written_bases(region, region.graph, {**outer, **inner})


def _aliased(value: torch.fx.Node) -> torch.fx.Node:
    """The tensor ``value`` looks at, through the views and detaches that alias it."""
    while value.op == "call_function" and isinstance(value.target, OpOverload) and value.args and \
            value.target._schema.returns and value.target._schema.returns[0].alias_info is not None and \
            isinstance(value.args[0], torch.fx.Node):
        value = value.args[0]
    return value


def refuse_unreplayable_effects(gm: torch.fx.GraphModule, model: str) -> None:
    """Raise :class:`CaptureError` for a forward whose effects a planned step cannot replay."""
    _refuse_parameter_updates(gm, model)
    _refuse_own_generators(gm, model)
