"""Running a module without leaving a trace: its buffers and the RNG stream come back unchanged, its parameters'
gradient hooks do not run."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from remat_plugin.capture.host_random import HostDraws
from remat_plugin.torch_private import suspended_tensor_hooks


@contextlib.contextmanager
def restored_buffers(module: nn.Module) -> Iterator[None]:
    """Buffers (BatchNorm running statistics, counters) hold on exit what they held on entry."""
    saved = {k: b.detach().clone() for k, b in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for k, b in module.named_buffers():
                b.copy_(saved[k])


@contextlib.contextmanager
def restored_inputs(inputs: Sequence[torch.Tensor]) -> Iterator[None]:
    """``inputs`` (the call's tensors its forward writes into) hold on exit what they held on entry."""
    saved = [t.detach().clone() for t in inputs]
    try:
        yield
    finally:
        with torch.no_grad():
            for t, value in zip(inputs, saved):
                t.copy_(value)


@contextlib.contextmanager
def unobserved(module: nn.Module, device: torch.device, inputs: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Neither ``module``'s buffers, nor the generator stream of ``device`` (and the CPU), nor Python's and NumPy's
    global generators (a fallback's forward runs as written: NOTE [host random draws]), nor ``inputs`` move.

    NOTE [parameter hooks unobserved]
        Hooks a caller put on the parameters (``p.register_hook``: gradient logging, a gradient accumulated into
        a buffer of its own; ``p.register_post_accumulate_grad_hook``: an optimizer stepped inside backward) are
        the caller's training step's, not ours: inside, they do not run.  A metered step (calibration, a
        fallback's sizing, an FSDP2 step, an auto-batch-size trial) ran them once more per step, and an
        optimizer stepped in backward took a step on the trial's gradients.  What such a hook allocates was then
        not in the metered peak: a hook clamping an embedding's gradient holds a second copy of it for a moment
        (154 MiB for GPT-2's).  A parameter with gradient hooks gets a stand-in instead, which copies the
        gradient (:func:`_as_a_hook_allocates`): the metered peak counts what a hook returning a new gradient
        allocates, and an observing hook's (logging a norm) is overcounted by that copy, on the budget's safe side."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), restored_buffers(module), \
            restored_inputs(inputs), HostDraws().restored(), \
            suspended_tensor_hooks(module.parameters(), stand_in=_as_a_hook_allocates):
        yield


def _as_a_hook_allocates(grad: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient hooks, stood in for in a metered step (NOTE [parameter hooks unobserved])."""
    return grad.clone()
