"""Launched by tests/test_rank_failures.py with ``accelerate launch`` and 2 CPU processes (gloo).

Trains a model torch.export cannot capture (each layer branches on a value) for a few steps
through :func:`remat_plugin.integrations.accelerate.prepare`; ``REMAT_BUDGET`` turns remat on.
A copy of the model trains alongside without remat, on the same batches and random streams,
as the oracle.  ``--inject WHERE`` makes one rank raise ``RuntimeError(MESSAGE)``:

- ``plan``: rank 0, while it plans (in place of ``plan_step``);
- ``replay``: rank 1, while it builds its step of rank 0's (fallback) plan;
- ``budget``: rank 1, while it computes its budget;
- ``own``: rank 1, while it plans its own shapes in the last step (see below).

After the agreed steps, one more step has rank 1 train on a doubled batch, which no plan covers: the ranks see
different shapes, so rank 1 plans its own (rank 0 has a step for its shapes).

A rank whose training raises writes ``OUT.rank<N>.raised.json`` (seconds into training, ``time.time()``, the
error), prints the same to stderr and re-raises.  Otherwise each rank writes ``OUT.rank<N>.json``.  (A file, not
only stderr: the launcher tails the ranks' logs and can drop a rank's last lines when it stops the other.)
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from remat_plugin.integrations import accelerate as remat_accelerate

MESSAGE = "injected planning failure"


class BranchyLayer(nn.Module):
    """A layer whose forward branches on a value: torch.export cannot capture it."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)  # checkpointing must replay its mask
        self.recomputed = 0  # forwards run inside backward: checkpointing's recomputations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputed += torch._C._current_graph_task_id() != -1
        h = torch.tanh(self.fc(x))
        if h.sum() > 0:
            h = h * 2
        return x + self.drop(h)


class BranchyNet(nn.Module):
    def __init__(self, width: int = 32, n_layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(BranchyLayer(width) for _ in range(n_layers))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def inject(where: str, rank: int) -> None:
    """Make ``rank`` raise ``RuntimeError(MESSAGE)`` at ``where`` (see the module docstring)."""
    from remat_plugin.runtime import resolver, session

    def fail(*args, **kwargs):
        raise RuntimeError(MESSAGE)

    if where == "plan" and rank == 0:
        resolver.plan_step = fail
    elif where == "replay" and rank == 1:
        resolver.fallback_step = fail
    elif where == "budget" and rank == 1:
        session.RematSession.training_budget = fail
    elif where == "own" and rank == 1:  # rank 1 replays rank 0's plans: plan_step runs only for its own shapes
        resolver.plan_step = fail


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True, metavar="OUT")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--inject", choices=["plan", "replay", "budget", "own"])
    opts = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    if opts.inject:
        inject(opts.inject, rank)
    set_seed(0)
    model = BranchyNet().double().train()
    plain = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    n = opts.steps * 8 * accelerator.num_processes
    data = TensorDataset(torch.randn(n, 32, dtype=torch.float64, generator=g),
                         torch.randn(n, dtype=torch.float64, generator=g))
    model = remat_accelerate.prepare(accelerator, model)
    plain = accelerator.prepare(plain)  # no hook: the run without remat
    optimizers = [accelerator.prepare(torch.optim.SGD(m.parameters(), lr=0.1)) for m in (model, plain)]
    loader = accelerator.prepare(DataLoader(data, batch_size=8))  # each rank its own batches

    losses: dict[str, list[float]] = {"ours": [], "plain": []}
    session = remat_accelerate.find_hook(model).session
    agreed: dict = {}
    t0 = time.perf_counter()
    try:
        batches = list(loader)
        for step, (x, y) in enumerate(batches + batches[-1:]):
            if step == len(batches):  # the uneven step
                agreed = {"plans": {k: p.to_json() for k, p in session.plans.items()}, "n_solved": session.n_solved}
                x, y = (torch.cat([x, x]), torch.cat([y, y])) if rank == 1 else (x, y)  # no plan covers it
            for name, m, optimizer in zip(("ours", "plain"), (model, plain), optimizers):
                torch.manual_seed(1000 * rank + step)  # the same dropout masks for both models
                loss = m(x, y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses[name].append(loss.item())
    except Exception as exc:
        raised = {"into_s": time.perf_counter() - t0, "at": time.time(), "error": f"{type(exc).__name__}: {exc}"}
        with open(f"{opts.json}.rank{rank}.raised.json", "w") as f:
            json.dump(raised, f)
        print(f"rank_failures: rank {rank} raised {raised['into_s']:.1f} s into training: {raised['error']}",
              file=sys.stderr, flush=True)
        # The launcher kills the other rank as soon as one exits: give it the moment it needs to print its own line
        # (the library has already raised on both ranks; this only keeps the launcher from hiding one of them).
        time.sleep(8)
        raise

    inner = [accelerator.unwrap_model(m) for m in (model, plain)]
    result = {
        "rank": rank, "world_size": accelerator.num_processes, "pid": os.getpid(), "losses": losses,
        "same_params": all(torch.equal(a, b) for a, b in zip(inner[0].parameters(), inner[1].parameters())),
        "param_sum": float(sum(p.detach().sum() for p in inner[0].parameters())),
        "recomputed": {name: [layer.recomputed for layer in m.layers] for name, m in zip(("ours", "plain"), inner)},
        "agreed": agreed,  # plans and count solved before the uneven step
        "n_solved": session.n_solved,
    }
    with open(f"{opts.json}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    # DDP's reducers go while the process group is alive: left to interpreter exit, gloo can abort a rank in their
    # destructor ("terminate called without an active exception"), as one CI-like run showed.
    del model, plain, optimizers, inner
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
