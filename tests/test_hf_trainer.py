"""transformers' Trainer with ``RematCallback``: a real ``Trainer.train`` against the one without it."""
import json
import logging
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from two_ranks import run_launch

from remat_plugin.errors import RematError
from remat_plugin.integrations.accelerate import find_hook
from remat_plugin.integrations.hf_trainer import RematCallback
from remat_plugin.ir.plan import Plan

CONFIG = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=500, n_positions=128, bos_token_id=0, eos_token_id=0)


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG).double()  # built from its config: use_cache on, dropout on, tied LM head


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, CONFIG.vocab_size, (64,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones(64, dtype=torch.long),
                "unused_column": i}  # the Trainer drops what the model's forward does not name


def _trainer(model, out, callbacks=(), **args) -> Trainer:
    arguments = TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, report_to=[],
                                  use_cpu=True, save_strategy="steps", save_steps=4, logging_steps=1,
                                  learning_rate=1e-3, seed=0, data_seed=0, gradient_accumulation_steps=2, **args)
    return Trainer(model=model, args=arguments, train_dataset=Tokens(), callbacks=list(callbacks))


def test_trainer_train_is_bitwise_the_run_without_it_and_saves_loadable_checkpoints(tmp_path, caplog):
    """float64, dropout on, gradient accumulation, gradient_checkpointing=True (turned off: the plan decides):
    every logged loss and the final weights bitwise those of a plain Trainer, under a budget that recomputes; the
    checkpoint is save_pretrained's, tied weights included, and loads into a plain model."""
    plain = _model()
    plain_trainer = _trainer(plain, tmp_path / "plain")
    plain_trainer.train()
    model = _model()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        trainer = _trainer(model, tmp_path / "remat", [RematCallback(budget="12MiB", verbose=False)],
                           gradient_checkpointing=True)
        trainer.train()
    hook = find_hook(model)
    assert hook is not None and hook.session is not None and hook.session.n_solved >= 1
    plans = list(hook.session.plans.values())
    assert plans and all(p.fallback is None for p in plans)
    assert any(b.mode != "keep" for p in plans for b in p.blocks)  # recomputing, not keeping everything
    assert all(p.predicted_peak_bytes <= p.budget_bytes for p in plans)
    assert "turning off gradient checkpointing" in caplog.text
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [h["loss"] for h in plain_trainer.state.log_history if "loss" in h] and len(losses) == 4
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(p, q), name
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "remat" / "checkpoint-4", dtype=torch.float64)
    assert all(torch.equal(p, q) for p, q in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_refusals_and_no_budget(tmp_path, monkeypatch, caplog):
    """torch_compile=True is refused when the Trainer is built, naming compile=True; without a budget (argument or
    REMAT_BUDGET) the callback says so and leaves the model alone; a bad option is refused at once."""
    with pytest.raises(RematError, match="compile=True"):
        _trainer(_model(), tmp_path / "a", [RematCallback(budget="12MiB")], torch_compile=True)
    monkeypatch.delenv("REMAT_BUDGET", raising=False)
    model = _model()
    with caplog.at_level(logging.INFO, logger="remat_plugin"):
        _trainer(model, tmp_path / "b", [RematCallback()])
    assert find_hook(model) is None and "no budget" in caplog.text
    monkeypatch.setenv("REMAT_BUDGET", "12MiB")
    model = _model()
    _trainer(model, tmp_path / "c", [RematCallback(verbose=False)])
    assert find_hook(model) is not None  # the launch flag's budget
    with pytest.raises(Exception, match="seq_bucket"):
        RematCallback(budget="12MiB", seq_bucket="fibonacci")


def test_bf16_trainer_is_bitwise_the_run_without_it(tmp_path, caplog):
    """bf16=True (the Trainer's Accelerator wraps the forward, the hook on it, in autocast): every loss and the
    final weights bitwise those of a plain bf16 Trainer; autocast is not left on (no backward seen inside it)."""
    plain, model = _model().float(), _model().float()
    plain_trainer = _trainer(plain, tmp_path / "plain", bf16=True)
    plain_trainer.train()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        trainer = _trainer(model, tmp_path / "remat", [RematCallback(budget="6MiB", verbose=False)], bf16=True)
        trainer.train()
    assert "torch.autocast block" not in caplog.text and not torch.is_autocast_enabled("cpu")
    plans = list(find_hook(model).session.plans.values())
    assert plans and all(p.fallback is None for p in plans) and any(b.mode != "keep" for p in plans for b in p.blocks)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [h["loss"] for h in plain_trainer.state.log_history if "loss" in h]
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(p, q), name


def _launch(tmp_path, name: str, env_extra: dict[str, str]) -> list[dict]:
    """Both ranks' results of ``tests/launch_scripts/hf_trainer_ddp.py`` under ``accelerate launch``."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REMAT_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"), **env_extra)
    out = tmp_path / name
    out.mkdir()
    with socket.socket() as s:  # a port of its own: other files' launches may run beside it (pytest-xdist)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(port),
               str(root / "tests" / "launch_scripts" / "hf_trainer_ddp.py"), str(out)]
    proc = run_launch(command, cwd=root, env=env, timeout=240)  # a rank's native abort at exit: launched again
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "profiler session is recording" not in proc.stderr and "torch.autocast block" not in proc.stderr
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_trainer_under_ddp_two_processes(tmp_path):
    """accelerate launch, 2 CPU processes (DDP over gloo), REMAT_BUDGET and a RematCallback without a budget: rank 0
    plans, rank 1 runs the same plan, and the losses and weights are bitwise those of the run without it."""
    plain = _launch(tmp_path, "plain", {})
    ours = _launch(tmp_path, "ours", {"REMAT_BUDGET": "12MiB"})
    assert [r["distributed_type"] for r in ours] == ["DistributedType.MULTI_CPU"] * 2
    assert [r["n_solved"] for r in ours] == [1, 0]  # rank 0 plans, rank 1 receives
    assert ours[0]["plans"] == ours[1]["plans"]
    plans = [Plan.from_json(p) for p in ours[0]["plans"]]
    assert plans and all(p.fallback is None and any(b.mode != "keep" for b in p.blocks) for p in plans)
    for mine, theirs in zip(ours, plain):
        assert mine["losses"] == theirs["losses"] and len(mine["losses"]) == 3
        assert mine["weights"] == theirs["weights"]
