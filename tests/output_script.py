"""Scripts for tests/test_output.py: what a run prints on stderr when it configures no logging.

    python tests/output_script.py plain | logging-configured | lightning

Each mode runs its cases in order and writes ``--- <case>`` to stderr before each, so the test
can tell which lines each case printed.
"""
from __future__ import annotations

import logging
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from remat_plugin import rematerialize

BUDGET = "2MiB"  # under the unmodified step's 2.06 MiB: the plan recomputes some blocks


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(128, 128), nn.Tanh())])


def case(name: str) -> None:
    print(f"--- {name}", file=sys.stderr, flush=True)


def plan_mlp(verbose: bool = True) -> None:
    rematerialize(mlp(), (torch.randn(512, 128),), budget=BUDGET, ilp_time_limit_s=0.2, verbose=verbose)


def plain() -> None:
    case("verbose=False")
    plan_mlp(verbose=False)
    case("default")
    plan_mlp()


def logging_configured() -> None:
    case("nothing configured")
    plan_mlp()
    case("root at WARNING")
    logging.basicConfig(format="user %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    plan_mlp()
    case("root at INFO")
    logging.getLogger().setLevel(logging.INFO)
    plan_mlp()


def lightning() -> None:
    import lightning.pytorch as pl

    from remat_plugin.integrations.lightning import AutoRemat

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    for verbose in (False, True):
        case(f"verbose={verbose}")
        trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[AutoRemat(budget=BUDGET, ilp_time_limit_s=0.2, verbose=verbose)])
        trainer.fit(Lit(), DataLoader(TensorDataset(torch.randn(512, 128)), batch_size=512))


if __name__ == "__main__":
    {"plain": plain, "logging-configured": logging_configured, "lightning": lightning}[sys.argv[1]]()
