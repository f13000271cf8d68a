"""Dataclass batches and outputs, flattened as their fields.

NOTE [dataclass inputs and outputs]
    A step's inputs and outputs are flattened with pytree (by the call's signature and by
    ``torch.export``), which knows tuples, lists, dicts, namedtuples and the types registered with it
    (transformers registers its ``ModelOutput``s).  A batch held in a dataclass (``Batch(x, y)``, usual
    in Lightning projects) or a dataclass the forward returns was an unknown type: ``torch.export``
    refused it ("Unsupported input type", "Found <class> in output") and the model fell back to
    per-layer checkpointing, while the signature keyed the batch by its ``repr``, tensor values and
    all.  Dataclasses met in a planned call's inputs or in its traced forward's output are registered
    with pytree through ``torch.export.register_dataclass`` (what export's own error asks for), so they
    are flattened as the fields their ``__init__`` takes and rebuilt by it.  The registration is global,
    as that call's is: the caller's own pytree use flattens the class too from then on.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from remat_plugin.torch_private import pytree


def register_dataclasses(tree: Any) -> None:
    """Register every dataclass type among ``tree``'s pytree leaves, nested ones too (NOTE [dataclass inputs and
    outputs])."""
    while True:
        new = {type(leaf) for leaf in pytree.tree_leaves(tree)
               if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type)
               and type(leaf) not in pytree.SUPPORTED_NODES}
        if not new:
            return
        for cls in new:
            try:
                torch.export.register_dataclass(cls)
            except Exception:  # noqa: BLE001 -- left unknown: export then names the type, as before
                return


@contextlib.contextmanager
def outputs_registered(module: nn.Module) -> Iterator[None]:
    """Inside, a dataclass ``module``'s forward returns is registered before ``torch.export`` flattens it."""
    handle = module.register_forward_hook(lambda _module, _args, output: register_dataclasses(output))
    try:
        yield
    finally:
        handle.remove()
