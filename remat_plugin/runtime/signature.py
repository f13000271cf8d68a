"""Shape buckets: which plan serves which inputs, so variable-length training does not re-plan every step.

An input signature (:func:`signature`) is plain JSON data: the pytree layout, and per leaf its
shape, dtype, device type and ``requires_grad`` (or the repr of a non-tensor), plus train and
grad mode.  Plans are made for *buckets*: the sequence length (dim 1 of integer and boolean
inputs: token ids, masks, labels) rounds up, by default to a power of two.  The batch
dimension is not rounded: a new batch size is a new bucket, while a smaller one (the last
partial batch) is served by the plan of the larger, since a plan for larger shapes of the
same graph is memory-safe (:func:`covers`).
"""
from __future__ import annotations

import json
import math
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

BucketPolicy = str | int | None  # "pow2", a multiple such as 64, or None (exact lengths)


def signature(module: nn.Module, args: tuple, kwargs: dict) -> list:
    """The JSON-able description of a call that a plan depends on."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    desc: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            desc.append([list(x.shape), str(x.dtype), x.device.type, bool(x.requires_grad)])
        else:
            desc.append(repr(x))
    return [str(spec), desc, bool(module.training), bool(torch.is_grad_enabled())]


def key_of(sig: list) -> str:
    """A stable string key for a signature (dict keys, checkpoints, cache file names)."""
    return json.dumps(sig, separators=(",", ":"))


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


def covers(big: list, small: list) -> bool:
    """Whether a plan for ``big`` serves ``small``: same layout, dtypes and modes, no dimension larger."""
    if big[0] != small[0] or big[2:] != small[2:] or len(big[1]) != len(small[1]):
        return False
    for b, s in zip(big[1], small[1]):
        if isinstance(b, str) or isinstance(s, str):
            if b != s:
                return False
            continue
        if b[1:] != s[1:] or len(b[0]) != len(s[0]) or any(x < y for x, y in zip(b[0], s[0])):
            return False
    return True


def volume(sig: list) -> int:
    """Total elements of a signature's tensors: among plans that cover a call, the smallest is the tightest."""
    return sum(math.prod(d[0]) for d in sig[1] if not isinstance(d, str))


def describe(key: str) -> str:
    """A signature key for people: the tensor inputs' shapes and dtypes (``8x128 int64, 8x128 int64``)."""
    try:
        sig = json.loads(key)
        parts = ["x".join(map(str, d[0])) + " " + d[1].removeprefix("torch.") for d in sig[1] if not isinstance(d, str)]
    except (ValueError, TypeError, IndexError, KeyError):
        return key[:120]
    return ", ".join(parts) or "no tensors"
