"""Views the trace made for strides a kernel does not produce: copied when they run, as eager's reshape copies.

NOTE [views of mistraced strides]
    The trace lays each value out as the ops' Meta kernels say, and records a ``view`` wherever those strides
    allow one (a Linear's flattening, a reshape).  Some Meta kernels lay their result out otherwise than the real
    kernel: on CPU, ``mse_loss_backward`` of a transposed prediction is row-major where its Meta kernel keeps the
    prediction's strides (PatchTST's loss), and a view that the traced strides allowed failed at the step's first
    run with "view size is not compatible with input tensor's size and stride" (torch.compile's ``aot_eager``
    fails alike; torch 2.13 and 2.14).  The eager programs' views run as :func:`view_or_copy`: the view where the
    real strides allow it, else a copy with the same values, which is what eager's reshape gives.  A copy is memory
    the plan did not count: it is logged, and calibration meters the step that makes it (NOTE [calibration]).
    The batch norms' Meta kernels, met first, are corrected while tracing instead (NOTE [batch norm layouts] in
    :mod:`remat_plugin.torch_private`), so the plan counts what their views copy.  Compiled programs lay out
    their values themselves and are left as they are.
"""
from __future__ import annotations

import logging

import torch
from torch import fx

log = logging.getLogger(__name__)

_VIEW = torch.ops.aten.view.default
_VIEWS = {_VIEW, torch.ops.aten._unsafe_view.default}


def view_or_copy(tensor: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``tensor.view(shape)``, or a copy of that shape where ``tensor``'s strides allow no view."""
    try:
        return _VIEW(tensor, shape)
    except RuntimeError:
        log.debug("a view of %s (strides %s) to %s was copied: it was traced for other strides",
                  tuple(tensor.shape), tensor.stride(), shape)
        return tensor.reshape(shape)


def views_copied_if_needed(gm: fx.GraphModule) -> int:
    """Run ``gm``'s views as :func:`view_or_copy` (NOTE [views of mistraced strides]); how many."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _VIEWS and not n.kwargs
             and len(n.args) == 2]
    for node in nodes:
        node.target = view_or_copy
    if nodes:
        gm.recompile()
    return len(nodes)
