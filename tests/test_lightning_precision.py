"""AutoRemat in a real ``Trainer.fit`` under Lightning's precision settings, against the same runs without it."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from remat_plugin.errors import RematError
from remat_plugin.integrations.lightning import AutoRemat
from remat_plugin.runtime.signature import describe

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import lightning_gpt2
from lightning_gpt2 import StepRecorder, load_options, train

TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.vocab_size=500", "model.n_positions=256",
        "data.batch_size=4", "data.seq_lens=[128]", "data.batches_per_len=4", "trainer.max_steps=4"]


def _run(precision, budget=None, **options):
    recorder = StepRecorder()
    auto = AutoRemat(budget=budget, ilp_time_limit_s=0.2, **options) if budget is not None else None
    callbacks = [auto, recorder] if auto is not None else [recorder]
    trainer, _ = train(load_options(None, [*TINY, f"trainer.precision={precision}"]), callbacks)
    return recorder, auto, trainer


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_fit_losses_bitwise_and_every_step_within_budget(precision):
    """Dropout on: every loss equals the run without AutoRemat, bitwise; every step within half its peak."""
    plain, _, _ = _run(precision)
    budget = max(plain.peaks) // 2
    ours, auto, _ = _run(precision, budget)
    assert ours.losses == plain.losses, (ours.losses, plain.losses)
    assert max(ours.peaks) <= budget, (ours.peaks, budget)
    plan = auto.session.plan
    assert any(b.mode != "keep" for b in plan.blocks)
    assert ("autocast cpu bfloat16" in describe(plan.signature)) == (precision == "bf16-mixed")


def test_compile_true_in_fit_matches_the_run_without_remat():
    """AutoRemat(compile=True) in a real Trainer.fit (float32, dropout on): the planned step runs as inductor
    kernels, every loss within 1e-5 of the run without AutoRemat, every step within the budget."""
    plain, _, _ = _run("32-true")
    budget = max(plain.peaks) // 2
    ours, auto, _ = _run("32-true", budget, compile=True)
    assert all(abs(a - b) <= 1e-5 for a, b in zip(ours.losses, plain.losses)), (ours.losses, plain.losses)
    assert max(ours.peaks) <= budget, (ours.peaks, budget)
    step = auto.session.resolver.latest
    assert all(getattr(p, "n_compiled", 0) > 0 for p in step.compiled_programs())


class CompiledGPT2Lit(lightning_gpt2.GPT2Lit):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.model = torch.compile(self.model)


def test_a_compiled_module_in_fit_is_refused_naming_compile_true(monkeypatch):
    monkeypatch.setattr(lightning_gpt2, "GPT2Lit", CompiledGPT2Lit)
    with pytest.raises(RematError, match=r"torch\.compile.*AutoRemat\(compile=True\)"):
        train(load_options(None, TINY), [AutoRemat(budget="100MiB")])


class ManualGPT2Lit(lightning_gpt2.GPT2Lit):
    """Manual optimization: manual_backward runs inside training_step, inside Lightning's autocast block."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        optimizer.zero_grad()
        loss = self.model(input_ids=batch, labels=batch).loss
        self.manual_backward(loss)
        optimizer.step()
        return {"loss": loss.detach()}


def test_manual_optimization_bf16_mixed_traces_backward_inside_autocast(monkeypatch, caplog):
    """With manual optimization the backward runs inside the autocast block; AutoRemat tells the session so
    from the first step: losses equal the run without AutoRemat bitwise, and no step is warned about."""
    monkeypatch.setattr(lightning_gpt2, "GPT2Lit", ManualGPT2Lit)
    plain, _, _ = _run("bf16-mixed")
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        ours, auto, _ = _run("bf16-mixed", max(plain.peaks) // 2)
    assert ours.losses == plain.losses, (ours.losses, plain.losses)
    assert auto.session.resolver.execution.backward_autocast
    assert "backward() ran" not in caplog.text


def test_unsupported_precision_is_refused_at_setup():
    auto = AutoRemat(budget="100MiB")
    with pytest.raises(RematError, match="precision 'transformer-engine' is not supported.*bf16-mixed"):
        auto.check_precision("transformer-engine")


def test_deepspeed_strategy_is_refused_at_setup():
    class DeepSpeedStrategy:  # what Lightning's strategy is called; deepspeed itself is not installed here
        pass

    with pytest.raises(RematError, match="DeepSpeedStrategy is not supported.*strategy='ddp'"):
        AutoRemat(budget="100MiB").check_strategy(DeepSpeedStrategy())
