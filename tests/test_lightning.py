"""AutoRemat in a real ``lightning.Trainer.fit`` on CPU, against the same runs without it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl

from remat_plugin.errors import InfeasibleBudgetError, RematError
from remat_plugin.integrations.lightning import AutoRemat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from lightning_gpt2 import GPT2Lit, StepRecorder, load_options, train

TINY = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.vocab_size=500", "model.n_positions=256",
        "data.batch_size=4", "trainer.precision=64-true"]


def _options(*overrides: str):
    return load_options(None, [*TINY, *overrides])


def _run(options, budget=None, callbacks=(), **kwargs):
    recorder = StepRecorder()
    callbacks = [recorder, *callbacks]
    auto = None
    if budget is not None:
        auto = AutoRemat(budget=budget, ilp_time_limit_s=0.2)
        callbacks.insert(0, auto)
    trainer, model = train(options, callbacks, **kwargs)
    return recorder, auto, trainer, model


def test_fit_losses_bitwise_and_every_step_within_half_the_unmodified_peak():
    """float64, dropout on: every loss equals the run without AutoRemat; every step (the first, planning included) ≤ B."""
    options = _options("data.seq_lens=[128]", "data.batches_per_len=3", "trainer.max_steps=3")
    plain, _, _, _ = _run(options)
    budget = max(plain.peaks) // 2
    ours, auto, trainer, _ = _run(options, budget)
    assert ours.losses == plain.losses
    assert max(ours.peaks) <= budget, (ours.peaks, budget)
    assert auto.session.n_solved == 1
    logged = trainer.callback_metrics  # the plan summary goes through pl_module.log
    assert logged["remat/predicted_peak_mib"] * 2**20 <= budget and logged["remat/blocks_recomputed"] >= 1
    assert any(b.mode != "keep" for b in auto.session.plan.blocks)  # half the peak needs recomputation


def test_growing_lengths_replan_once_per_bucket_and_shorter_ones_reuse():
    """64 → 128 → 256 plan once each; 200 and 100 (buckets 256, 128) and 64 again replay; never over B."""
    lengths = [64, 128, 256, 200, 100, 64]
    options = _options(f"data.seq_lens={lengths}", "data.batches_per_len=1", f"trainer.max_steps={len(lengths)}",
                       "trainer.precision=32-true")
    plain, _, _, _ = _run(options)
    budget = max(plain.peaks) // 2
    ours, auto, _, _ = _run(options, budget)
    session = auto.session
    assert session.n_solved == 3, list(session.plans)
    assert session.n_replayed == 2  # 200 and 100; the second 64 reuses its step
    assert max(ours.peaks) <= budget, (ours.peaks, budget)
    assert ours.losses == pytest.approx(plain.losses, rel=1e-5)


def test_checkpoints_load_both_ways_and_resume_without_replanning(tmp_path):
    """ModelCheckpoint files saved with AutoRemat load into a plain model; resuming either kind with AutoRemat
    gives the losses of the uninterrupted run, and the plan comes back from the checkpoint."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    # One batch per epoch: Lightning restarts a plain DataLoader on resume, so only then is the
    # uninterrupted run's data order the resumed one's.  No dropout: the global RNG is not checkpointed.
    options = _options("data.seq_lens=[128]", "data.batches_per_len=1", "model.dropout=0.0")
    budget = 10**12  # generous: the plan keeps everything; what is tested is the plumbing

    def run_saving(where, with_remat):
        saver = ModelCheckpoint(dirpath=tmp_path / where, every_n_epochs=1, save_top_k=-1)
        recorder, _, _, model = _run(options, budget if with_remat else None, max_steps=3, callbacks=[saver],
                                     enable_checkpointing=True)
        return recorder, model, min((tmp_path / where).glob("epoch=0*.ckpt"))

    ours, _, ours_ckpt = run_saving("remat", True)
    plain, _, plain_ckpt = run_saving("plain", False)
    assert ours.losses == plain.losses

    state = torch.load(ours_ckpt, weights_only=False)
    fresh = GPT2Lit(**vars(options.model)).double()
    fresh.load_state_dict(state["state_dict"], strict=True)  # the keys are the plain model's
    assert set(state["state_dict"]) == set(GPT2Lit(**vars(options.model)).state_dict())
    plain_state = torch.load(plain_ckpt, weights_only=False)["state_dict"]
    for name, p in fresh.state_dict().items():
        assert torch.equal(p, plain_state[name]), name

    resumed, auto, _, _ = _run(options, budget, max_steps=3, ckpt_path=str(ours_ckpt))
    from_plain, _, _, _ = _run(options, budget, max_steps=3, ckpt_path=str(plain_ckpt))
    assert resumed.losses == plain.losses[1:]
    assert from_plain.losses == plain.losses[1:]
    assert auto.session.n_solved == 0 and auto.session.n_replayed == 1  # replayed the checkpoint's plan


def test_teardown_restores_forward_and_bad_module_name_is_named():
    """After fit the target's forward is its class's again; a wrong ``module=`` names the children."""
    options = _options("data.seq_lens=[64]", "data.batches_per_len=1", "trainer.max_steps=1")
    _, auto, _, model = _run(options, 10**12)
    assert "forward" not in model.model.__dict__
    assert auto.session.n_solved == 1
    with pytest.raises(RematError, match="no submodule 'encoder'.*'model'"):
        train(options, [AutoRemat(budget=10**12, module="encoder")])


class _CopyDuringFit(pl.Callback):
    """What an EMA callback does: a deep copy of the module while AutoRemat runs it, then the copy's own forward."""

    def __init__(self):
        self.checked = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.checked:
            return
        copy_ = __import__("copy").deepcopy(pl_module.model)
        ids = batch[:1]  # the example feeds token ids as one tensor
        with torch.no_grad():
            for p in copy_.parameters():
                p.mul_(0.5)  # the copy's parameters differ from the module's from here on
            copy_.eval()
            mine = copy_(input_ids=ids).logits
            plain = type(copy_).forward(copy_, input_ids=ids).logits  # the copy's class forward on its own weights
            live = type(pl_module.model).forward(pl_module.model, input_ids=ids).logits
        assert torch.equal(mine, plain) and not torch.equal(mine, live)
        self.checked = True


def test_a_deep_copy_during_fit_runs_its_own_parameters():
    """A deep copy of the module AutoRemat runs (an EMA or averaged model) is a plain copy: its forward computes with
    its own parameters (NOTE [copies of a module we run]); it used to run the live module's."""
    options = _options("data.seq_lens=[64]", "data.batches_per_len=1", "trainer.max_steps=2")
    check = _CopyDuringFit()
    _run(options, 10**12, callbacks=[check])
    assert check.checked


def test_module_none_picks_what_training_step_runs():
    """``module=None`` picks ``self.model`` (largest child); with ``self(...)`` in training_step, the module itself."""
    from remat_plugin.integrations.lightning import pick_target

    class CallsSelf(GPT2Lit):
        def forward(self, ids):
            return self.model(input_ids=ids, labels=ids).loss

        def training_step(self, batch, batch_idx):
            return self(batch)

    options = _options()
    assert pick_target(GPT2Lit(**vars(options.model)), None)[0] == "model"
    assert pick_target(CallsSelf(**vars(options.model)), None)[0] == ""


class _BuiltInConfigureModel(pl.LightningModule):
    """Builds its GPT-2 in ``configure_model`` (after the callbacks' setup), as Lightning advises for big models."""

    def __init__(self):
        super().__init__()
        self.model = None

    def configure_model(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        if self.model is None:
            torch.manual_seed(0)
            config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64, use_cache=False,
                                bos_token_id=0, eos_token_id=0)
            self.model = GPT2LMHeadModel(config).double()

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _fit_built_in_configure_model(callbacks) -> tuple[list[float], pl.LightningModule]:
    data = torch.utils.data.DataLoader(
        [torch.randint(0, 500, (64,), generator=torch.Generator().manual_seed(i)) for i in range(12)], batch_size=4)
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    module = _BuiltInConfigureModel()
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", precision="64-true", callbacks=[*callbacks, Losses()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    torch.manual_seed(1)
    trainer.fit(module, data)
    return losses, module


def test_a_model_built_in_configure_model_is_rewritten_once_it_exists():
    """At the callbacks' setup the LightningModule has no parameters yet: AutoRemat used to rewrite it, whose forward
    training_step never calls, so training ran without remat, silently.  It now rewrites ``self.model`` when fit
    starts: one plan, recomputing, and the losses of the run without it, bitwise."""
    plain, _ = _fit_built_in_configure_model([])
    # 7 MiB less the 2.08 MiB of AdamW state still to come: 4.92 MiB for the first step, against an unmodified peak
    # of 11.83 MiB and floors of 3.8-4.1 MiB (logits freed) and 4.6-5.1 MiB (kept), as time-limited ILPs find them
    # on a busy CPU (6 MiB left 3.92 MiB, below the 4.10 MiB one CI run's ILPs found)
    auto = AutoRemat(budget="7MiB", ilp_time_limit_s=0.2, verbose=False)
    ours, module = _fit_built_in_configure_model([auto])
    assert auto.session is not None and auto.session.module is module.model and auto.session.n_solved >= 1
    assert any(b.mode != "keep" for p in auto.session.plans.values() for b in p.blocks)
    assert ours == plain and len(ours) == 3


def test_a_rewritten_module_the_training_step_never_calls_is_said():
    """``module=""`` rewrites the LightningModule's own forward, which this training_step never calls: the first
    step says so, naming the fix, instead of training without remat silently."""
    auto = AutoRemat(budget="6MiB", module="", ilp_time_limit_s=0.2, verbose=False)
    with pytest.warns(UserWarning, match=r"never called .*module='model'"):
        _fit_built_in_configure_model([auto])
    assert auto.session is not None and not auto.session.plans


def test_hf_gradient_checkpointing_is_turned_off_with_a_warning():
    """Ours and HF's per-layer checkpointing would both recompute: HF's is switched off, and the user told."""
    options = _options("data.seq_lens=[64]", "data.batches_per_len=1", "trainer.max_steps=1")

    class WithHFCheckpointing(GPT2Lit):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.model.gradient_checkpointing_enable()

    pl.seed_everything(0)
    model = WithHFCheckpointing(**vars(options.model))
    auto = AutoRemat(budget=10**12)
    from lightning_gpt2 import TokenData

    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, callbacks=[auto])
    with pytest.warns(UserWarning, match="turning off gradient checkpointing"):
        trainer.fit(model, datamodule=TokenData(batch_size=2, seq_lens=[64], batches_per_len=1, vocab_size=500))
    assert auto.session.n_solved == 1


@pytest.mark.slow
def test_ddp_two_processes_same_plan_and_losses(tmp_path):
    """strategy="ddp", 2 CPU processes: rank 0 plans, rank 1 receives the same plan; losses equal DDP without it."""
    common = [*TINY, "data.seq_lens=[128]", "data.batches_per_len=2", "trainer.max_steps=2", "trainer.devices=2",
              "trainer.strategy=ddp", "example.compare_unmodified=false", "remat.ilp_time_limit_s=0.2"]
    single, _, _, _ = _run(_options("data.seq_lens=[128]", "data.batches_per_len=1", "trainer.max_steps=1"))
    budget = max(single.peaks) * 6 // 10
    ours = _launch_ddp(tmp_path, common, f"remat.budget={budget}")
    plain = _launch_ddp(tmp_path, common, "example.remat=false")
    assert [r["world_size"] for r in ours] == [2, 2] and ours[0]["pid"] != ours[1]["pid"]
    assert ours[0]["plans"] == ours[1]["plans"] and len(ours[0]["plans"]) == 1
    assert [r["n_solved"] for r in ours] == [1, 0]
    for mine, theirs in zip(ours, plain):
        assert mine["losses"] == theirs["losses"]
        assert max(mine["peaks"]) <= budget


def _launch_ddp(tmp_path: Path, common: list[str], *extra: str) -> list[dict]:
    """The example under ``trainer.strategy=ddp`` with 2 processes; each rank's results."""
    out = tmp_path / ("remat" if "example.remat=false" not in extra else "plain")
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_gpt2.py"), *common, f"example.out={out}", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_ddp_below_the_first_plans_floor_trains_with_the_logits_given_no_gradient(tmp_path):
    """strategy="ddp", 2 CPU processes, a budget below the floor of a first plan that keeps the logits with their
    gradient (a large vocabulary makes them most of the step): rank 0 plans them held without a gradient (NOTE
    [loss-only first plan]), then freed after the forward for a training_step that drops them (NOTE [refined
    step-down]); both ranks train on those plans within the budget, losses equal DDP without it."""
    from remat_plugin import rematerialize
    from remat_plugin.ir.plan import Plan

    vocab, tokens = 8000, (4, 128)
    common = [*TINY, f"model.vocab_size={vocab}", f"data.seq_lens=[{tokens[1]}]", "data.batches_per_len=2",
              "trainer.max_steps=2", "trainer.devices=2", "trainer.strategy=ddp", "example.compare_unmodified=false",
              "remat.ilp_time_limit_s=0.2"]
    options = _options(*common)
    hf = GPT2Lit(**vars(options.model)).model.double().train()
    ids = torch.randint(0, vocab, tokens)
    first = rematerialize(hf, (), {"input_ids": ids, "labels": ids}, budget=10**12, verbose=False).plan
    held = rematerialize(hf, (), {"input_ids": ids, "labels": ids}, budget=first.min_feasible_bytes - 2**20,
                         verbose=False).plan
    assert held.ungraded_outputs == (1,), held
    # halfway between the floors of the two first plans: the ranks' time-limited ILPs may find floors a little apart
    budget = (first.min_feasible_bytes + held.min_feasible_bytes) // 2
    ours = _launch_ddp(tmp_path, common, f"remat.budget={budget}")
    plain = _launch_ddp(tmp_path, common, "example.remat=false")
    assert ours[0]["plans"] == ours[1]["plans"] and [r["n_solved"] for r in ours] == [1, 0]
    plan = Plan.from_json(next(iter(ours[0]["plans"].values())))
    # held without a gradient, then freed for the training_step, which returns only the loss (NOTE [refined
    # step-down]); a gradient into them is still refused
    assert (plan.ungraded_outputs, plan.dropped_outputs) == ((), (1,))
    assert plan.loss_only_floors == (first.min_feasible_bytes,)
    for mine, theirs in zip(ours, plain):
        assert mine["losses"] == theirs["losses"]
        assert max(mine["peaks"]) <= budget


def test_a_training_step_returning_its_logits_gets_a_plan_that_holds_them(caplog):
    """A ``training_step`` returning ``{"loss": ..., "logits": ...}``: Lightning holds the returned dict through
    backward() and a detached copy of the logits until ``on_train_batch_end``.  The re-plan gives them no gradient
    and keeps them, never frees them: every step within the budget, no warning."""
    import logging

    from lightning_gpt2 import TokenData

    class ReturnsLogits(GPT2Lit):
        def training_step(self, batch, batch_idx):
            out = self.model(input_ids=batch, labels=batch)
            return {"loss": out.loss, "logits": out.logits}

    options = _options("data.seq_lens=[64]", "data.batches_per_len=4")
    unmodified, _, _, _ = _run(options, max_steps=4)
    budget = int(0.8 * max(unmodified.peaks))  # above the floor of a plan holding the logits (0.60 of the peak)
    pl.seed_everything(0, verbose=False)
    model = ReturnsLogits(**vars(options.model))
    recorder, auto = StepRecorder(), AutoRemat(budget=budget, ilp_time_limit_s=0.2)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, precision="64-true", callbacks=[auto, recorder],
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        trainer.fit(model, datamodule=TokenData(vocab_size=options.model.vocab_size, **vars(options.data)))
    assert "kept or differentiated" not in caplog.text, caplog.text
    assert len(recorder.peaks) == 4 and max(recorder.peaks) <= budget, (recorder.peaks, budget)
    plan = auto.session.plan
    assert plan.dropped_outputs == () and plan.ungraded_outputs == (1,)


def test_batch_size_finder_trials_run_unmodified_then_one_plan():
    """BatchSizeFinder's trial steps (before us) do not plan; the batch size it settles on is planned once."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    options = _options("data.seq_lens=[64]", "data.batches_per_len=16", "trainer.max_steps=2", "data.batch_size=2")
    finder = BatchSizeFinder(mode="power", steps_per_trial=1, max_trials=2)
    recorder, auto, _, _ = _run(options, 10**12, callbacks=[finder])
    assert finder.optimal_batch_size > 2  # trials ran at 2 and larger sizes
    assert auto.session.n_solved == 1 and len(recorder.losses) == 2
    assert json.loads(next(iter(auto.session.plans)))[1][0][0] == [finder.optimal_batch_size, 64]


def test_auto_batch_size_takes_the_largest_that_fits_and_one_real_step():
    """auto_batch_size: the chosen size's steps stay under B; size + multiple_of has no plan under B (predicted
    floor above it); one verification step; training runs at the new size without planning again."""
    options = _options("data.seq_lens=[128]", "data.batches_per_len=64", "trainer.max_steps=2", "data.batch_size=4",
                       "trainer.precision=32-true")
    budget = 40 * 2**20
    recorder = StepRecorder()
    auto = AutoRemat(budget=budget, auto_batch_size=True, multiple_of=4, ilp_time_limit_s=0.2)
    trainer, _ = train(options, [auto, recorder])
    choice = auto.batch_size_choice
    assert choice.batch_size > 4 and choice.batch_size % 4 == 0
    assert recorder.batch_sizes == [choice.batch_size] * 2
    assert trainer.datamodule.batch_size == choice.batch_size
    assert max(recorder.peaks) <= budget and choice.measured_peak_bytes <= choice.budget_bytes
    # one verification step, whose plan training replays; a second only when that step, planned on its own
    # capture, finds no plan within B right at the boundary, and then one notch lower (batch_size/tune.py)
    assert choice.trial_steps in (1, 2) and auto.session.n_solved == 1
    assert choice.batch_size == choice.chosen.batch_size - 4 * (choice.trial_steps - 1)
    nxt = choice.next_size
    assert nxt.batch_size == choice.chosen.batch_size + 4 and nxt.predicted_time_ms is None
    assert nxt.min_feasible_bytes > choice.budget_bytes


def test_auto_batch_size_under_bf16_mixed_plans_the_step_training_runs():
    """The search runs in Lightning's training-step context: under bf16-mixed it planned the fp32 step outside
    autocast (a batch of 32 under 40 MiB), and training planned its autocast step again (found 2026-11-29)."""
    options = _options("data.seq_lens=[128]", "data.batches_per_len=64", "trainer.max_steps=2", "data.batch_size=4",
                       "trainer.precision=bf16-mixed")
    budget = 40 * 2**20
    recorder = StepRecorder()
    auto = AutoRemat(budget=budget, auto_batch_size=True, multiple_of=4, ilp_time_limit_s=0.2)
    train(options, [auto, recorder])
    choice = auto.batch_size_choice
    assert recorder.batch_sizes == [choice.batch_size] * 2 and max(recorder.peaks) <= budget
    assert auto.session.n_solved == 1, "training replays the plan the search verified"


def test_auto_batch_size_beside_a_loss_plans_the_logits_held_without_a_gradient():
    """A large vocabulary makes the logits most of the step: sizes are planned with them held without a gradient,
    as the first plan steps down to (NOTE [loss-only first plan]), so the chosen size is one whose plan with the
    logits differentiated would not fit; training runs it within the budget."""
    from remat_plugin import rematerialize
    from remat_plugin.planning.choose_plan import make_plan
    from remat_plugin.runtime.steps import captured_problem

    vocab = 8000
    options = _options(f"model.vocab_size={vocab}", "data.seq_lens=[128]", "data.batches_per_len=64",
                       "trainer.max_steps=2", "data.batch_size=2")
    hf = GPT2Lit(**vars(options.model)).model.double().train()
    ids = torch.randint(0, vocab, (4, 128))
    four = rematerialize(hf, (), {"input_ids": ids, "labels": ids}, budget=10**12, verbose=False).plan
    budget = four.min_feasible_bytes * 21 // 20  # the keep-all floor of 4 sequences, and a little
    recorder = StepRecorder()
    auto = AutoRemat(budget=budget, auto_batch_size=True, ilp_time_limit_s=0.2)
    train(options, [auto, recorder])
    choice = auto.batch_size_choice
    assert choice.ungraded_outputs == (1,) and "held without a gradient" in choice.summary()
    assert choice.batch_size > 4 and recorder.batch_sizes == [choice.batch_size] * 2
    assert max(recorder.peaks) <= budget and choice.measured_peak_bytes <= budget
    plan = next(iter(auto.session.plans.values()))  # then freed for the training_step (NOTE [refined step-down])
    assert (plan.ungraded_outputs, plan.dropped_outputs) == ((), (1,)) and len(plan.loss_only_floors) == 1
    ids = torch.randint(0, vocab, (choice.batch_size, 128))
    keep_all = captured_problem(hf, (), {"input_ids": ids, "labels": ids})
    with pytest.raises(InfeasibleBudgetError):  # a search keeping every output stops lower
        make_plan(keep_all.problem, keep_all.constants, choice.budget_bytes, 0.2)


@pytest.mark.slow
def test_auto_batch_size_under_ddp_agrees_across_ranks(tmp_path):
    """strategy="ddp" (which BatchSizeFinder refuses): both ranks train at the same chosen size within B."""
    out = tmp_path / "abs"
    budget = 40 * 2**20
    cmd = [sys.executable, str(ROOT / "examples" / "lightning_gpt2.py"), *TINY, "trainer.precision=32-true",
           "data.seq_lens=[128]", "data.batches_per_len=64", "trainer.max_steps=2", "trainer.devices=2",
           "trainer.strategy=ddp", "example.compare_unmodified=false", "example.auto_batch_size=true",
           "example.multiple_of=2", f"remat.budget={budget}", "remat.ilp_time_limit_s=0.2", f"example.out={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    sizes = {tuple(r["batch_sizes"]) for r in ranks}
    assert len(sizes) == 1 and next(iter(sizes))[0] > 4
    assert all(max(r["peaks"]) <= budget for r in ranks)
