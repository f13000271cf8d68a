"""Tensors the forward keeps on its modules (``self.last_attention = attn``), which a traced graph cannot keep.

NOTE [tensors the forward keeps]
    A forward that stores a tensor on a module (an attention map kept for plotting, a statistic in a dict, an
    auxiliary loss the training loop adds: ``loss = out + model.moe.aux_loss``) does so in Python, which a
    planned step does not run.  ``torch.export`` left the trace's fake tensor there (reading it after a step
    raised, or a loop's auxiliary loss mixed a fake tensor into the real one) and only printed a warning (found
    2026-11-28).  torch's own check names the attributes (and list or dict entries) the trace assigned tensors
    to, and puts back those that existed before; its warning is kept, and the attributes new to the module, which
    it leaves holding fake tensors, are removed.  A new attribute holding a tensor with no gradient, built from
    constants only (not from the call's arguments, parameters or buffers: :class:`CallDerived` follows them
    through a second trace, run only for such models, since following every call costs a sixth of an export), is
    taken for a cache the forward fills once (Phi-3's long-context rotary frequencies): removed, so an eager call
    fills it again, and the capture goes on.  Any other (an attribute that existed, or
    a new one computed from the call, both written at every call, which a planned step would leave unset or
    stale: ``self.last = x.detach()``; a tensor requiring grad, which a loop reads as a loss) refuses the capture,
    naming them and the fix (return the tensor from ``forward``, or write it into a registered buffer in place:
    ``self.last.copy_(x)``).  A model with repeated layers falls back to per-layer checkpointing, whose forward
    runs as written and sets them at every step.
"""
from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from remat_plugin.capture.graded_constants import tensors_held
from remat_plugin.errors import CaptureError
from remat_plugin.torch_private import FakeTensor, pytree

log = logging.getLogger(__name__)

# what torch.export warns when the trace assigned tensor attributes (torch/_functorch/_aot_autograd/frontend_utils.py)
_TORCH_SAYS = re.compile(r"The tensor attributes? (.*) (?:were|was) assigned during export")


class CallDerived(TorchFunctionMode):
    """Follows, through a trace, which tensors are computed from the call: from a fake tensor the trace did not
    make itself (an argument, a parameter, a buffer), as opposed to one built from constants (``torch.arange``)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, torch.Tensor] = {}  # every tensor a call returned, held so that no id is reused
        self.derived: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        derived = any(isinstance(a, FakeTensor) and (id(a) in self.derived or id(a) not in self.made)
                      for a in pytree.tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        for o in (out,) if isinstance(out, torch.Tensor) else pytree.tree_leaves(out):
            if isinstance(o, torch.Tensor):
                self.made[id(o)] = o
                if derived:
                    self.derived.add(id(o))
        return out

    def holds_derived(self, value: Any) -> bool:
        return any(id(t) in self.derived for _, t in tensors_held(value))


class AssignedTensors:
    """The tensors a traced forward set on its modules, named by torch's own check (the warning it prints, which
    this keeps to itself): :attr:`names` refuse the capture, :attr:`caches` (new attributes holding no gradient)
    are removed from the module and only said."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.caches: list[str] = []

    @contextlib.contextmanager
    def recorded(self, module: nn.Module, derived: CallDerived | None = None) -> Iterator[None]:
        """``derived``: followed through the trace, which new attributes' tensors are computed from the call."""
        before = {id(sub): set(vars(sub)) for sub in module.modules()}
        shown = warnings.showwarning
        said: list[str] = []

        def show(message, category, filename, lineno, file=None, line=None):
            found = _TORCH_SAYS.match(str(message))
            if found is None:
                return shown(message, category, filename, lineno, file, line)
            said.extend(name.removeprefix("self.") for name in found.group(1).split(", ")
                        if "_flat_weights[" not in name)  # nn.LSTM's weights list: export's own swap
            return None

        warnings.filterwarnings("always", message=_TORCH_SAYS.pattern)
        warnings.showwarning = show
        try:
            with derived if derived is not None else contextlib.nullcontext():
                yield
        finally:
            warnings.showwarning = shown
            for name in sorted(set(said)):  # torch names them in a set's order
                path, _, attr = name.split("[")[0].rpartition(".")
                sub = module.get_submodule(path) if path else module
                if _reparametrized(sub, attr):
                    continue
                value = vars(sub).get(attr)
                if attr in before.get(id(sub), ()) or not _holds_fake(value) or _holds_fake(value, graded=True) \
                        or (derived is not None and derived.holds_derived(value)):
                    self.names.append(name)  # written at every call, or read by the loop (an auxiliary loss)
                else:
                    self.caches.append(name)
                if attr not in before.get(id(sub), ()) and _holds_fake(value):
                    delattr(sub, attr)  # torch puts back the attributes it saw before, not new ones

    def check(self, model: str) -> None:
        if self.caches and not self.names:
            log.info("remat_plugin.capture: %s's forward set %s, which a planned step does not set: removed, so an "
                     "eager call sets them again", model, ", ".join(self.caches))
        if self.names:
            raise CaptureError(
                f"remat_plugin.capture: {model}'s forward stores tensors on its modules ({', '.join(self.names[:5])}"
                f"{', ...' if len(self.names) > 5 else ''}), which a planned step cannot do: it runs the traced graph, "
                "not the forward's Python. Return such a tensor from forward (an auxiliary loss, an attention map), "
                "or write it into a registered buffer in place (self.last.copy_(x))")


def _reparametrized(module: nn.Module, attr: str) -> bool:
    """``attr`` is the weight torch's hook-based reparametrisations (``prune``, ``spectral_norm``, the old
    ``weight_norm``) recompute from their parameters before every forward: the graph computes it."""
    params = dict(module.named_parameters(recurse=False))
    return f"{attr}_orig" in params or (f"{attr}_g" in params and f"{attr}_v" in params)


def _holds_fake(value: Any, graded: bool = False) -> bool:
    """``value`` is, or holds in a list or dict, a fake tensor (one requiring grad, with ``graded``)."""
    return any(isinstance(t, FakeTensor) and (t.requires_grad or not graded) for _, t in tensors_held(value))
