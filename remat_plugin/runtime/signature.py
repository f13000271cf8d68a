"""Input signatures and shape buckets: which plan serves which call.

A :class:`Signature` is what a plan depends on: the pytree layout of the call, per tensor leaf its
shape, dtype, device type, ``requires_grad`` and, where it is not contiguous, its strides (per other
leaf its repr: NOTE [Python values in a call] in :mod:`remat_plugin.runtime.resolver`), train and grad
mode, the caller's autocast settings (the joint graph holds the casts autocast made), whether
``torch.use_deterministic_algorithms`` is on (AOTAutograd's backward checks it is as traced), and the
module's state: the names, shapes and dtypes of its parameters and buffers,
which parameters require gradients (unfreezing a layer or adding an adapter is a new graph), and its
module hooks (NOTE [module hooks] in :mod:`remat_plugin.capture.module_hooks`).  The Python values its modules
hold are not part of it: each step is guarded by them (NOTE [module attributes] in
:mod:`remat_plugin.capture.module_attributes`).  Its :attr:`~Signature.key` is plain JSON (dict keys, checkpoints, cache file names).

Plans are made for *buckets*: the sequence length (dim 1 of integer and boolean inputs: token
ids, masks, labels) rounds up, by default to a power of two.  The batch dimension is not
rounded: a new batch size is a new bucket, while a smaller one (the last partial batch) is
served by the plan of the larger, since a plan for larger shapes of the same graph is
memory-safe (:meth:`Signature.covers`).

A :class:`Call` also carries the identities of the module's parameter and buffer tensors: a
built step holds the tensors it was traced with, so a Parameter replaced since (``tie_weights``,
``layer.weight = nn.Parameter(...)``) must rebuild the step, though its plan still applies.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat_plugin.capture.dataclass_trees import register_dataclasses
from remat_plugin.capture.module_hooks import hooks_state
from remat_plugin.torch_private import autocast_state, pytree

BucketPolicy = str | int | None  # "pow2", a multiple such as 64, or None (exact lengths)

TensorLeaf = tuple[tuple[int, ...], str, str, bool, tuple[int, ...]]  # shape, dtype, device, requires_grad, strides


@dataclass(frozen=True)
class Signature:
    """The description of a call that a plan depends on; see the module docstring."""

    layout: str
    leaves: tuple[TensorLeaf | str, ...]
    training: bool
    grad_enabled: bool
    state: str = ""  # fingerprint of the module's parameters and buffers (module_state)
    autocast: tuple[tuple[str, str, bool], ...] = ()  # per enabled device type: (device, dtype, cache_enabled)
    # torch.use_deterministic_algorithms: AOTAutograd's backward refuses to run under another setting than its
    # forward was traced under, so a step traced before the caller turned it on raised mid-step
    deterministic: bool = False

    @classmethod
    def of(cls, module: nn.Module, args: tuple, kwargs: dict, state: str | None = None) -> Signature:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        desc: list[TensorLeaf | str] = [
            (tuple(x.shape), str(x.dtype), x.device.type, bool(x.requires_grad), _strides(x))
            if isinstance(x, torch.Tensor) else repr(x)
            for x in leaves
        ]
        if state is None:
            state = module_state(module)[0]
        return cls(str(spec), tuple(desc), bool(module.training), bool(torch.is_grad_enabled()), state,
                   autocast_state(), torch.are_deterministic_algorithms_enabled())

    @property
    def key(self) -> str:
        """A stable string for this signature (JSON)."""
        leaves = [x if isinstance(x, str) else [list(x[0]), x[1], x[2], x[3], *([list(x[4])] if x[4] else [])]
                  for x in self.leaves]
        return json.dumps([self.layout, leaves, self.training, self.grad_enabled, self.state,
                           [list(a) for a in self.autocast], *(["deterministic"] if self.deterministic else [])],
                          separators=(",", ":"))  # the usual keys unchanged: plans cached on disk still match

    @classmethod
    def from_key(cls, key: str) -> Signature:
        layout, leaves, training, grad, *rest = json.loads(key)  # older keys lack the state and autocast
        state = rest[0] if rest else ""
        autocast = tuple(tuple(a) for a in rest[1]) if len(rest) > 1 else ()
        return cls(layout, tuple(x if isinstance(x, str) else (tuple(x[0]), x[1], x[2], x[3], tuple(x[4] if x[4:] else ()))
                                 for x in leaves),
                   training, grad, state, autocast, rest[2:3] == ["deterministic"])  # type: ignore[arg-type]

    def covers(self, small: Signature) -> bool:
        """Whether a plan for ``self`` serves ``small``: same layout, dtypes and modes, no dimension larger.

        Strides are left out: the step replaying the plan is traced at the call's own strides, and a graph they
        change is not the plan's graph (:class:`~remat_plugin.runtime.steps.PlanMismatch`, planned anew).
        """
        if (self.layout, self.training, self.grad_enabled, self.state, self.autocast, self.deterministic) != (
                small.layout, small.training, small.grad_enabled, small.state, small.autocast, small.deterministic):
            return False
        if len(self.leaves) != len(small.leaves):
            return False
        for b, s in zip(self.leaves, small.leaves):
            if isinstance(b, str) or isinstance(s, str):
                if b != s:
                    return False
                continue
            if b[1:4] != s[1:4] or len(b[0]) != len(s[0]) or any(x < y for x, y in zip(b[0], s[0])):
                return False
        return True

    @property
    def volume(self) -> int:
        """Total elements of the tensors: among plans that cover a call, the smallest is the tightest."""
        return sum(math.prod(x[0]) for x in self.leaves if not isinstance(x, str))

    def describe(self) -> str:
        """For people: the tensor inputs' shapes and dtypes (``8x128 int64, 8x128 int64``)."""
        parts = [("x".join(map(str, x[0])) or "scalar") + " " + x[1].removeprefix("torch.") for x in self.leaves
                 if not isinstance(x, str)]
        text = ", ".join(parts) or "no tensors"
        for device, dtype, _ in self.autocast:
            text += f" (autocast {device} {dtype.removeprefix('torch.')})"
        return text


def python_values(args: tuple, kwargs: dict) -> dict[str, str]:
    """The call's values other than tensors (and None), by where they sit (``kwargs['num_items_in_batch']``), as
    the signature records them (their repr)."""
    flat, _ = pytree.tree_flatten_with_path((args, kwargs))
    return {("args" if getattr(path[0], "idx", 0) == 0 else "kwargs") + pytree.keystr(path[1:]): repr(x)
            for path, x in flat if not isinstance(x, torch.Tensor) and x is not None}


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    """A tensor's strides where they are not the contiguous ones, else ``()``: the traced graph holds views and
    reshapes made for the strides it saw (a ``reshape`` of a contiguous input is a ``view``, which a transposed or
    ``channels_last`` input of the same shape refuses), so a call with other strides needs a step of its own."""
    return () if x.is_contiguous() or x.layout != torch.strided else tuple(x.stride())


def describe(key: str) -> str:
    """A signature key for people (see :meth:`Signature.describe`); other text is shortened."""
    try:
        return Signature.from_key(key).describe()
    except (ValueError, TypeError, IndexError, KeyError):
        return key[:120]


def module_state(module: nn.Module) -> tuple[str, tuple[int, ...]]:
    """The module's parameters and buffers: a fingerprint of what the graph depends on, and their identities.

    The fingerprint covers names, shapes, dtypes and ``requires_grad``, and the module hooks
    (NOTE [module hooks]); the identities tell a replaced tensor of the same kind apart (see the
    module docstring).
    """
    parts: list[str] = []
    ids: list[int] = []
    for kind, named in (("p", module.named_parameters()), ("b", module.named_buffers())):
        for name, t in named:
            parts.append(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}:{int(t.requires_grad)}")
            ids.append(id(t))
    hooks = hooks_state(module)
    if hooks:  # models without hooks keep the fingerprint they had before hooks counted (plans on disk)
        parts.append(f"h:{hooks}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:12], tuple(ids)


def device_of(args: tuple, kwargs: dict, module: nn.Module) -> torch.device:
    """The device the step runs on: that of the first tensor input, else of the parameters."""
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return x.device
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@dataclass(frozen=True)
class Call:
    """One call of the module: its arguments, signature and device, passed along as one value."""

    args: tuple
    kwargs: dict
    signature: Signature
    device: torch.device
    tensor_ids: tuple[int, ...] = ()  # identities of the module's parameters and buffers (module_state)

    @classmethod
    def of(cls, module: nn.Module, args: tuple, kwargs: dict) -> Call:
        args, kwargs = tuple(args), dict(kwargs)
        register_dataclasses((args, kwargs))  # NOTE [dataclass inputs and outputs]
        state, ids = module_state(module)
        return cls(args, kwargs, Signature.of(module, args, kwargs, state), device_of(args, kwargs, module), ids)

    @property
    def key(self) -> str:
        return self.signature.key


def round_length(n: int, policy: BucketPolicy) -> int:
    """``n`` rounded up under ``policy``."""
    if policy is None or n <= 0:
        return n
    if policy == "pow2":
        return 1 << (n - 1).bit_length()
    if isinstance(policy, int) and not isinstance(policy, bool) and policy > 0:
        return math.ceil(n / policy) * policy
    raise ValueError(f"remat_plugin: seq_bucket {policy!r} is not 'pow2', a positive int or None")


def _is_sequence_input(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.ndim >= 2 and not (x.dtype.is_floating_point or x.dtype.is_complex)


def bucketed_inputs(args: tuple, kwargs: dict, policy: BucketPolicy) -> tuple[tuple, dict, bool]:
    """Inputs shaped like the bucket of ``(args, kwargs)`` (zeros where lengths grow); ``changed`` if any grew."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    changed = False
    out = []
    for x in leaves:
        if _is_sequence_input(x):
            length = round_length(x.shape[1], policy)
            if length != x.shape[1]:
                shape = (x.shape[0], length, *x.shape[2:])
                x = torch.zeros(shape, dtype=x.dtype, device=x.device)  # zeros are valid ids, labels and masks
                changed = True
        out.append(x)
    new_args, new_kwargs = pytree.tree_unflatten(out, spec)
    return tuple(new_args), dict(new_kwargs), changed
