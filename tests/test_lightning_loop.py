"""AutoRemat under the training loops Lightning users write: gradient accumulation, layers unfrozen mid-run."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl

from remat_plugin.integrations.lightning import AutoRemat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from lightning_gpt2 import StepRecorder, load_options, train

TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.vocab_size=500", "model.n_positions=256",
        "data.batch_size=4", "trainer.precision=64-true", "data.seq_lens=[128]"]


def _run(options, budget=None, callbacks=(), **kwargs):
    recorder = StepRecorder()
    auto = AutoRemat(budget=budget, ilp_time_limit_s=0.2, verbose=False) if budget is not None else None
    _, model = train(options, [*([auto] if auto else []), recorder, *callbacks], **kwargs)
    return recorder, auto, model


def test_accumulate_grad_batches_losses_equal_the_run_without_remat():
    """accumulate_grad_batches=4: 8 micro-batches, 2 optimizer steps; every loss equals the plain run's, bitwise."""
    options = load_options(None, [*TINY, "data.batches_per_len=8", "trainer.max_steps=2"])
    plain, _, plain_model = _run(options, accumulate_grad_batches=4)
    budget = max(plain.peaks) // 2
    ours, auto, our_model = _run(options, budget, accumulate_grad_batches=4)
    assert len(ours.losses) == 8 and ours.losses == plain.losses
    assert auto.session.n_solved == 1 and any(b.mode != "keep" for b in auto.session.plan.blocks)
    for (name, p), q in zip(our_model.named_parameters(), plain_model.parameters()):
        assert p.equal(q), name  # the accumulated updates too


class UnfreezeAt(pl.Callback):
    """Progressive unfreezing: the first layer trains only from batch ``at`` on."""

    def __init__(self, at: int):
        self.at = at

    def _first_layer(self, pl_module):
        return pl_module.model.transformer.h[0]

    def on_train_start(self, trainer, pl_module):
        self._first_layer(pl_module).requires_grad_(False)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            self._first_layer(pl_module).requires_grad_(True)


def test_unfreezing_mid_run_replans_and_losses_equal_the_run_without_remat():
    options = load_options(None, [*TINY, "data.batches_per_len=4", "trainer.max_steps=4"])
    plain, _, _ = _run(options, callbacks=[UnfreezeAt(2)])
    budget = max(plain.peaks) * 6 // 10
    ours, auto, model = _run(options, budget, callbacks=[UnfreezeAt(2)])
    assert ours.losses == plain.losses
    assert auto.session.n_solved == 2  # the unfrozen layer's gradients are a new graph
    assert model.model.transformer.h[0].attn.c_attn.weight.grad is not None
    assert max(ours.peaks) <= budget, (ours.peaks, budget)


class DropoutTo(pl.Callback):
    """Dropout annealing: every dropout's probability changes at batch ``at`` (NOTE [module attributes])."""

    def __init__(self, at: int, p: float):
        self.at, self.p = at, p

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            for m in pl_module.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = self.p


def test_a_dropout_probability_changed_mid_run_takes_effect():
    """A callback lowers every dropout's p at batch 2: the planned steps follow it (they kept the planned p,
    silently), and every loss equals the run without remat, bitwise, each step within the budget."""
    options = load_options(None, [*TINY, "data.batches_per_len=4", "trainer.max_steps=4"])
    plain, _, _ = _run(options, callbacks=[DropoutTo(2, 0.05)])
    budget = max(plain.peaks) * 6 // 10
    ours, _, _ = _run(options, budget, callbacks=[DropoutTo(2, 0.05)])
    assert ours.losses == plain.losses
    assert max(ours.peaks) <= budget, (ours.peaks, budget)


class _TowerModule(pl.LightningModule):
    """A model torch.export cannot capture (a branch on a value), a dropout in its tower: the metered fallback."""

    def __init__(self):
        super().__init__()
        from test_api import _TowerAndLayers

        torch.manual_seed(0)
        self.model = _TowerAndLayers()
        for block in self.model.tower:
            block.insert(2, torch.nn.Dropout(0.1))
        self.losses: list[float] = []

    def training_step(self, batch, index):
        loss = self.model(batch[0][0], batch[1][0])
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_model_without_a_graph_fits_with_the_losses_of_the_run_without_remat(precision):
    """NOTE [metered fallback] in ``Trainer.fit``: the step metered under the precision's autocast checkpoints some
    layers, its measured peak within the budget, and every loss (dropout on) equals the run without AutoRemat."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4, 256, 64, generator=g), torch.randn(4, 8, 64, generator=g))

    def fit(callbacks):
        module = _TowerModule()
        torch.manual_seed(1)
        trainer = pl.Trainer(max_steps=4, precision=precision, callbacks=callbacks, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu", devices=1)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
        return module.losses

    budget = int(5.6 * 2**20)  # below the unmodified step (8.9 and 6.1 MiB), above every layer checkpointed
    auto = AutoRemat(budget=budget, ilp_time_limit_s=0.2, module="model", verbose=False)
    assert fit([auto]) == fit([])
    plan = auto.session.plan
    assert plan.fallback and 0 < sum(b.mode == "checkpoint" for b in plan.blocks) < 8
    assert 0 < plan.predicted_peak_bytes <= budget < plan.baseline_peak_bytes, plan.table()


class _EpochScaled(pl.LightningModule):
    """A warm-up that ends at epoch 1, read in the forward as Lightning's ``self.current_epoch`` (a property that
    reads the trainer's loop)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                         for _ in range(4)))
        self._losses: list[float] = []  # private: a public list of values would be watched too

    def forward(self, x):
        h = self.net(x)
        return (h if self.current_epoch < 1 else h * 2.0).square().mean()

    def training_step(self, batch, batch_idx):
        loss = self(batch[0])
        self._losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        data = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)


def test_the_current_epoch_read_in_the_forward_takes_effect():
    """``self.current_epoch`` in the planned forward: the planned steps of epoch 1 ran epoch 0's branch, silently
    (found 2026-11-29; NOTE [properties the forward reads]).  Every loss of two epochs equals the plain run's."""
    losses = []
    for callbacks in ([], [AutoRemat(budget=10**9, ilp_time_limit_s=0.2, verbose=False)]):
        model = _EpochScaled()
        pl.Trainer(max_epochs=2, precision="64-true", accelerator="cpu", logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks).fit(model)
        losses.append(model._losses)
    assert len(losses[1]) == 4 and losses[1] == losses[0]
    assert callbacks[0].session.n_solved == 2, "epoch 1's branch is another graph, planned at its first step"


class _LogsInItsForward(_EpochScaled):
    def forward(self, x):
        h = self.net(x)
        self.log("h_mean", h.mean())
        return h.square().mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self._logged.append(float(self.trainer.callback_metrics["h_mean"]))


def test_self_log_in_the_forward_falls_back_naming_the_call_and_logs_every_value(caplog):
    """Lightning's ``self.log`` in the planned forward cannot be traced (export failed in a ``deepcopy`` of a fake
    tensor, a message naming ``copy.py``): the fallback's warning names the model's line and the fix, and the
    fallback, which runs the forward's Python, logs the values the plain run logs."""
    logged = []
    for callbacks in ([], [AutoRemat(budget=10**9, ilp_time_limit_s=0.2, verbose=False)]):
        model = _LogsInItsForward()
        model._logged = []
        with caplog.at_level(logging.WARNING, logger="remat_plugin"):
            pl.Trainer(max_epochs=1, precision="64-true", accelerator="cpu", logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks).fit(model)
        logged.append(model._logged)
    assert len(logged[1]) == 2 and logged[1] == logged[0]
    assert "test_lightning_loop.py" in caplog.text and "(forward)" in caplog.text, caplog.text
    assert "calls Lightning's self.log" in caplog.text and "log it in training_step" in caplog.text
