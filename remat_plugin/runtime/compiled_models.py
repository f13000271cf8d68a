"""A model the user wrapped in ``torch.compile`` is refused, with the way to have remat and compiled kernels both.

Dynamo would trace our dispatcher (capture, planning, the planned programs) as part of the
user's compiled graph, or run the model without our plan: neither is what was asked for.
``compile=True`` (``AutoRemat(compile=True)``, ``REMAT_COMPILE=1``) plans the module itself and
compiles the planned programs (NOTE [compiled programs] in :mod:`remat_plugin.capture.compiled_programs`).
"""
from __future__ import annotations

from torch import nn

from remat_plugin.errors import RematError
from remat_plugin.torch_private import is_compiled_module


def refuse_compiled(module: nn.Module, way: str) -> None:
    """Raise :class:`RematError` naming ``way`` when ``module`` is a ``torch.compile`` wrapper."""
    if is_compiled_module(module):
        inner = type(getattr(module, "_orig_mod", module)).__name__
        raise RematError(f"remat_plugin: the model ({inner}) is wrapped in torch.compile, which would run it without "
                         f"the plan; pass the uncompiled module and use {way} to compile the planned step")
