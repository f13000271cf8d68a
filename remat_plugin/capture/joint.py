"""Read an AOTAutograd joint forward+backward graph as a planning :class:`Problem`.

Each op of the problem is one call of the joint graph that allocates storage.  Views
(``view``, ``t``, ``expand``, ``_unsafe_view`` …) and ``getitem`` are folded away:
a reader of a view reads the view's base value, and the executor re-derives the view
(free) wherever it is needed.  Placeholders (parameters, inputs, tangents) are outside
the problem: always alive, costing nothing, except tangents, which a synthetic first
backward op "makes" so their bytes count from the start of the backward.

NOTE [dropped outputs]
    A step's outputs stay alive to the end of the step (``live_out``) unless the caller is
    known to drop them before ``backward()`` (``JointGraph.dropped_outputs``, learned from an
    observed step: a training step keeps ``.loss`` and drops the logits).  A dropped output
    is read by a synthetic last forward op ``__outputs_returned__``: alive until the forward
    returns it, then freed at its last read like any other value.

NOTE [random ops]
    A random op gets a synthetic forward op ``<name>__rng`` just before it, which
    captures the generator state (unrecomputable, a few KiB).  Recomputing the
    random op reads that state and replays the very same random numbers.
"""
from __future__ import annotations

import functools
import hashlib
import operator
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import fx

from remat_plugin.capture.dropped_tangents import add_if_given
from remat_plugin.capture.stride_fallbacks import view_or_copy
from remat_plugin.ir.problem import Op, Problem, Value
from remat_plugin.torch_private import OpOverload, PlainAOTOutput, extract_fwd_bwd_outputs, is_tangent

TANGENTS_OP = "__tangents__"
OUTPUTS_OP = "__outputs_returned__"
RNG_SUFFIX = "__rng"
RNG_STATE_BYTES = {"cpu": 5056, "cuda": 16}


def _tensor_device(val) -> str | None:
    """The device of an op's (first) tensor output, as a string ("cpu", "cuda:0")."""
    for v in val if isinstance(val, (tuple, list)) else (val,):
        if isinstance(v, torch.Tensor):
            return str(v.device)
    return None

_ALIAS_OPS = {
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    add_if_given,  # the gradient itself, for a dropped output's missing tangent (NOTE [dropped tangents])
    view_or_copy,  # a program's view, copied only where a kernel laid its input out otherwise than traced
}


def is_view_target(target) -> bool:
    if target in _ALIAS_OPS:
        return True
    if isinstance(target, OpOverload):
        rets = target._schema.returns
        return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)
    return False


def _is_random(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def _tensor_bytes(val) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    try:
        return int(val.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # tensors without storage: dense size
        return int(val.numel() * val.element_size())


def _node_args(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found


@dataclass
class JointGraph:
    """The joint graph plus what the planner needs to know about each node."""

    gm: fx.GraphModule
    num_fwd_outputs: int
    device_type: str
    ops: list[fx.Node] = field(default_factory=list)  # storage-making calls, fwd first then bwd
    is_fwd: dict[str, bool] = field(default_factory=dict)
    root: dict[str, str | None] = field(default_factory=dict)  # node name -> value name holding its storage
    values_of: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unread_output_bytes: dict[str, int] = field(default_factory=dict)
    random_ops: set[str] = field(default_factory=set)
    rng_device: dict[str, str] = field(default_factory=dict)  # random op -> the device whose generator it draws from
    live_out: set[str] = field(default_factory=set)
    tangents: list[fx.Node] = field(default_factory=list)
    buffer_primals: set[str] = field(default_factory=set)  # placeholders that are module buffers
    state_primals: set[str] = field(default_factory=set)  # placeholders that are parameters or buffers
    grad_primals: set[str] = field(default_factory=set)  # placeholders that require grad
    real_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # placeholder -> the step's tensor (profiling)
    dropped_outputs: frozenset[int] = frozenset()  # user outputs the caller drops before backward (NOTE above)
    absent_tangents: frozenset[str] = frozenset()  # their tangents, arriving as None (NOTE [dropped tangents])
    output_roots: dict[int, str] = field(default_factory=dict)  # user output index -> value holding its storage
    output_positions: dict[int, int] = field(default_factory=dict)  # user output index -> joint output position
    # backward add -> the operand it is written into (NOTE [in-place sums in the plan]); empty where adds stay
    # out of place (compiled programs)
    sums_in_place: dict[str, str] = field(default_factory=dict)

    def node(self, name: str) -> fx.Node:
        return self._by_name[name]

    @functools.cached_property
    def structure_key(self) -> str:
        """What a schedule depends on: the graph's ops and their targets, not their sizes (equal at every shape
        that traces the same code)."""
        desc = "|".join(f"{n.name}:{n.target}" for n in self.ops)
        return hashlib.sha1(f"{self.num_fwd_outputs}|{desc}".encode()).hexdigest()[:16]

    def __post_init__(self) -> None:
        self._by_name = {n.name: n for n in self.gm.graph.nodes}
        self._analyse()

    def _analyse(self) -> None:
        graph = self.gm.graph
        fwd: list[fx.Node] = []
        bwd: list[fx.Node] = []
        for n in graph.nodes:
            if n.op == "placeholder":
                self.root[n.name] = None
                if is_tangent(n):
                    self.tangents.append(n)
                continue
            if n.op != "call_function":
                continue
            args = _node_args(n)
            if n.target is operator.getitem:
                src = args[0]
                if src.name in self.values_of or src.op != "call_function" or not is_view_target(src.target):
                    self.root[n.name] = n.name  # one output of a multi-output op
                else:
                    self.root[n.name] = self.root.get(_node_args(src)[0].name)
                continue
            if is_view_target(n.target):
                tensor_args = [a for a in args if isinstance(a.meta.get("val"), torch.Tensor)]
                self.root[n.name] = self.root.get(tensor_args[0].name) if tensor_args else None
                continue
            val = n.meta.get("val")
            if val is None:
                continue  # asserts and other calls without an output: not executed by plans
            self._add_op(n, val)
            (fwd if n.meta.get("partitioner_tag") == "is_forward" else bwd).append(n)
        self.ops = fwd + bwd
        for n in fwd:
            self.is_fwd[n.name] = True
        for n in bwd:
            self.is_fwd[n.name] = False
        out = next(n for n in graph.nodes if n.op == "output")
        for a in _node_args(out):
            r = self.root.get(a.name)
            if r is not None:
                self.live_out.add(r)
        fwd_outs, _, fwd_descs, _ = extract_fwd_bwd_outputs(self.gm, num_fwd_outputs=self.num_fwd_outputs)
        for position, (node, desc) in enumerate(zip(fwd_outs, fwd_descs)):
            if isinstance(desc, PlainAOTOutput) and isinstance(node, fx.Node) and self.root.get(node.name):
                self.output_roots[desc.idx] = cast(str, self.root[node.name])
                self.output_positions[desc.idx] = position

    def dropped_values(self) -> list[str]:
        """Values only dropped outputs hold (NOTE [dropped outputs]); an output sharing storage with
        another output, a gradient or a mutated input stays live."""
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        dropped_positions = {self.output_positions[i] for i in self.dropped_outputs if i in self.output_positions}
        held = {self.root.get(a.name) for i, a in enumerate(out.args[0])
                if isinstance(a, fx.Node) and i not in dropped_positions}
        dropped = [self.output_roots[i] for i in sorted(self.dropped_outputs) if i in self.output_roots]
        return list(dict.fromkeys(v for v in dropped if v not in held))

    def _add_op(self, n: fx.Node, val) -> None:
        if isinstance(val, torch.Tensor):
            self.root[n.name] = n.name
            self.values_of[n.name] = (n.name,)
            self.unread_output_bytes[n.name] = 0
        else:
            getitems = {cast(int, u.args[1]): u for u in n.users if u.target is operator.getitem}
            self.values_of[n.name] = tuple(
                getitems[i].name for i in sorted(getitems) if isinstance(getitems[i].meta.get("val"), torch.Tensor)
            )
            self.unread_output_bytes[n.name] = sum(
                _tensor_bytes(v) for i, v in enumerate(val) if i not in getitems
            )
            self.root[n.name] = None
        if _is_random(n):
            self.random_ops.add(n.name)
            # a CPU random op inside a CUDA model (randperm for a sampler) draws from the CPU generator
            self.rng_device[n.name] = _tensor_device(val) or self.device_type

    def constant_ops(self) -> set[str]:
        """Forward ops the planner treats as constants: those that do not mix a user input with a
        trainable tensor.  Rotary tables and T5's bias table read only parameters and buffers; masks
        read only the ``attention_mask`` input; neither is on the path gradients flow along."""
        from_input: set[str] = set()
        from_grad: set[str] = set()
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                if n.name not in self.state_primals:
                    from_input.add(n.name)
                if n.name in self.grad_primals:
                    from_grad.add(n.name)
                continue
            args = _node_args(n)
            if any(a.name in from_input for a in args):
                from_input.add(n.name)
            if any(a.name in from_grad for a in args):
                from_grad.add(n.name)
        return {n.name for n in self.ops if self.is_fwd[n.name] and not (n.name in from_input and n.name in from_grad)}

    def reads(self, n: fx.Node) -> tuple[str, ...]:
        """Internal values an op reads (views resolved to their base), in first-read order."""
        out: list[str] = []
        for a in _node_args(n):
            r = self.root.get(a.name)
            if r is not None and r not in out:
                out.append(r)
        return tuple(out)

    def value_bytes(self, name: str) -> int:
        return self._device_bytes(_tensor_bytes(self.node(name).meta.get("val")))

    def _device_bytes(self, nbytes: int) -> int:
        """What the allocator really hands out: the CUDA caching allocator rounds to 512 bytes."""
        return -(-nbytes // 512) * 512 if self.device_type == "cuda" else nbytes

    def to_problem(self, time_ms: dict[str, float], temp_bytes: dict[str, int]) -> Problem:
        """The planning problem with the given per-op costs (ops missing from the dicts cost nothing)."""
        ops: list[Op] = []
        values: list[Value] = []
        tangent_names = {t.name for t in self.tangents}
        dropped = self.dropped_values()
        live_out = self.live_out - set(dropped)
        held_outputs = live_out & set(self.output_roots.values())  # not buffer updates, which AOTAutograd copies back
        returned = Op(OUTPUTS_OP, True, tuple(dropped), (), 0.0, recomputable=False) if dropped else None
        storage_of: dict[str, str] = {}  # a sum written into an operand -> the value whose storage it is
        in_forward = True  # the synthetic ops between forward and backward are still to come
        for n in self.ops:
            if in_forward and not self.is_fwd[n.name]:
                in_forward = False
                if returned is not None:
                    ops.append(returned)
                if self.tangents:
                    ops.append(Op(TANGENTS_OP, False, (), tuple(t.name for t in self.tangents), 0.0))
                    values.extend(
                        Value(t.name, 0 if t.name in self.absent_tangents
                              else self._device_bytes(_tensor_bytes(t.meta.get("val"))), TANGENTS_OP)
                        for t in self.tangents
                    )
            reads = list(self.reads(n))
            reads += [a.name for a in _node_args(n) if a.name in tangent_names and a.name not in reads]
            if n.name in self.random_ops:
                rng = n.name + RNG_SUFFIX
                ops.append(Op(rng, True, (), (rng,), 0.0, 0, recomputable=False))
                rng_type = torch.device(self.rng_device.get(n.name, self.device_type)).type
                values.append(Value(rng, RNG_STATE_BYTES.get(rng_type, 16), rng))
                reads.append(rng)
            reads += [storage_of[r] for r in reads if r in storage_of and storage_of[r] not in reads]
            outs = self.values_of[n.name]
            into = self.sums_in_place.get(n.name)  # NOTE [in-place sums in the plan]
            operand = self.root.get(into) if into is not None else None  # the value holding the operand's storage
            if operand is not None and outs == (n.name,):
                storage_of[n.name] = storage_of.get(operand, operand)
            temp = temp_bytes.get(n.name, 0) + self.unread_output_bytes[n.name]
            returned_here = self.is_fwd[n.name] and bool(set(outs) & held_outputs)  # the caller's: never recomputed
            ops.append(Op(n.name, self.is_fwd[n.name], tuple(reads), outs, time_ms.get(n.name, 0.0), temp,
                          recomputable=not returned_here))
            values.extend(Value(v, 0 if v in storage_of else self.value_bytes(v), n.name) for v in outs)
        if in_forward and returned is not None:
            ops.append(returned)
        live_out |= {storage_of[v] for v in live_out if v in storage_of}
        return Problem(tuple(ops), tuple(values), frozenset(live_out))
