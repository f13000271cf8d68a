"""The Accelerate integration: RematHook and prepare in process, and real `accelerate launch` / `remat launch` runs."""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
from accelerate import Accelerator
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset

from remat_plugin import cli
from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.errors import BudgetFormatError, RematError
from remat_plugin.integrations import accelerate as remat_accelerate
from remat_plugin.integrations.accelerate import (
    RematPlugin,
    choose_batch_size,
    find_hook,
    plans_file,
    rebuild_dataloader,
)
from remat_plugin.integrations.checkpointing import find_double_checkpointing
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "accelerate_gpt2.py"
ILP_S = 0.2


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No REMAT_* from the caller's shell, and a fresh Accelerate state per test."""
    for var in [v for v in os.environ if v.startswith("REMAT_")]:
        monkeypatch.delenv(var)
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def _gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64, use_cache=False,
                        bos_token_id=499, eos_token_id=499)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).double().train()
    model.loss_type = "ForCausalLM"
    return model


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 500, (4, 64), generator=torch.Generator().manual_seed(seed))


def _forced_budget(model, share: float = 0.6) -> int:
    """``share`` of the unmodified forward+backward peak: feasible, and only with recomputation."""
    probe = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]), PeakMeter("cpu") as meter:
        probe(input_ids=_ids(0), labels=_ids(0)).loss.backward()
    return int(meter.peak_bytes * share)


def _step(model, ids, seed: int):
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


class _CountingHook(ModelHook):
    """Another hook on the same module: ours must compose with it in either order."""

    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs


# --- in process ---------------------------------------------------------------------------------
def test_gradients_bitwise_equal_to_the_unmodified_model_under_a_budget_that_forces_recomputation():
    """float64, dropout on, two steps: losses and gradients equal the model without the hook, bit for bit."""
    plain, ours = _gpt2(), _gpt2()
    budget = _forced_budget(plain)
    model = remat_accelerate.prepare(Accelerator(cpu=True), ours, budget=budget, ilp_time_limit_s=ILP_S)
    hook = find_hook(model)
    assert hook is not None and hook.session is not None
    for step in range(2):
        want, got = _step(plain, _ids(step), seed=step), _step(model, _ids(step), seed=step)
        assert torch.equal(want, got)
        for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
            assert torch.equal(p.grad, q.grad), name
    plan = hook.session.plan
    assert hook.session.n_solved == 1 and plan is not None and plan.budget_bytes == budget
    assert any(b.mode != "keep" for b in plan.blocks), plan.table()


def test_removing_the_hook_restores_forward_and_keeps_state_dict_keys():
    """Appended after another hook and before a third, the hook plans; remove_hook_from_module undoes all of it."""
    model, reference = _gpt2(), _gpt2()
    keys = list(model.state_dict())
    first, last = _CountingHook(), _CountingHook()
    add_hook_to_module(model, first)
    prepared = remat_accelerate.prepare(Accelerator(cpu=True), model, budget=10**12, ilp_time_limit_s=ILP_S)
    add_hook_to_module(model, last, append=True)  # Accelerate detaches and re-inits ours: its plans stay
    hook = find_hook(prepared)
    assert hook is not None and hook.attached
    _step(prepared, _ids(0), seed=0)
    calls = first.calls  # planning's capture (torch.export) calls the module through the hooks once more
    _step(prepared, _ids(0), seed=0)
    assert hook.session is not None and hook.session.n_solved == 1 and first.calls == last.calls == calls + 1
    assert list(model.state_dict()) == keys

    remove_hook_from_module(model)
    assert not hook.attached and find_hook(model) is None
    assert "_hf_hook" not in model.__dict__ and "_old_forward" not in model.__dict__
    assert model.forward.__func__ is type(model).forward and model.forward.__self__ is model
    assert list(model.state_dict()) == keys
    reference.load_state_dict(model.state_dict())
    assert torch.equal(_step(model, _ids(1), seed=1), _step(reference, _ids(1), seed=1))
    assert hook.session.n_solved == 1 and first.calls == calls + 1  # the call went straight to the original forward


def test_save_state_load_state_round_trip_with_the_hook(tmp_path):
    """save_state/load_state restore weights and optimizer exactly and carry the plans: a resumed run goes on
    with the same losses, replaying the checkpoint's plan instead of solving."""
    model = _gpt2()
    budget = _forced_budget(model, share=0.8)  # AdamW's state to come is taken out of it
    accelerator = Accelerator(cpu=True)
    model = remat_accelerate.prepare(accelerator, model, budget=budget, ilp_time_limit_s=ILP_S)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def train(model, optimizer, step: int) -> float:
        loss = _step(model, _ids(step), seed=step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    train(model, optimizer, 0)
    accelerator.save_state(str(tmp_path))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    after_save = [train(model, optimizer, 1), train(model, optimizer, 2)]
    assert (tmp_path / plans_file(0)).exists()
    assert any(b.mode != "keep" for b in find_hook(model).session.plan.blocks)  # type: ignore[union-attr]

    fresh = Accelerator(cpu=True)  # a resumed run: new model, optimizer and hook
    resumed = remat_accelerate.prepare(fresh, _gpt2(seed=1), budget=budget, ilp_time_limit_s=ILP_S)
    resumed_opt = fresh.prepare(torch.optim.AdamW(resumed.parameters(), lr=1e-3))
    fresh.load_state(str(tmp_path))
    assert all(torch.equal(saved[k], v) for k, v in resumed.state_dict().items())
    assert [train(resumed, resumed_opt, 1), train(resumed, resumed_opt, 2)] == after_save
    session = find_hook(resumed).session  # type: ignore[union-attr]
    assert session.n_solved == 0 and session.n_replayed == 1  # the checkpoint's plan, replayed


def test_invalid_remat_budget_stops_prepare_naming_the_variable_and_the_forms(monkeypatch):
    """REMAT_BUDGET=eighty: prepare raises before anything is prepared, naming the variable and the accepted forms."""
    monkeypatch.setenv("REMAT_BUDGET", "eighty")
    accelerator = Accelerator(cpu=True)
    with pytest.raises(BudgetFormatError, match=r"REMAT_BUDGET='eighty'.*'12GiB'.*'80%'.*unset it"):
        remat_accelerate.prepare(accelerator, _gpt2())
    assert accelerator._models == []


def test_invalid_remat_budget_stops_the_example_before_training():
    """The same through the example script: it exits non-zero with the message, and no step ran."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMAT_")}
    env.update(REMAT_BUDGET="eighty", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--cpu", "--steps", "1"], cwd=ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "REMAT_BUDGET='eighty' is invalid" in proc.stderr and "'80%'" in proc.stderr
    assert "step 0" not in proc.stdout


def test_without_a_budget_prepare_is_plain_accelerate(caplog):
    """No budget argument and no REMAT_BUDGET: exactly accelerator.prepare(model), and the log says so."""
    model = _gpt2()
    with caplog.at_level(logging.INFO, logger="remat_plugin"):
        prepared = remat_accelerate.prepare(Accelerator(cpu=True), model)
    assert prepared is model and find_hook(model) is None and "_hf_hook" not in model.__dict__
    assert "training without remat" in caplog.text


def test_arguments_win_over_the_plugin_and_the_environment(monkeypatch):
    """budget= beats a bad REMAT_BUDGET; unset fields come from REMAT_*; a second prepare and an unknown option
    are named."""
    monkeypatch.setenv("REMAT_BUDGET", "eighty")
    monkeypatch.setenv("REMAT_SEQ_BUCKET", "exact")
    monkeypatch.setenv("REMAT_ILP_TIME_LIMIT_S", "0.3")
    model = remat_accelerate.prepare(Accelerator(cpu=True), _gpt2(), budget="1GB")
    hook = find_hook(model)
    assert hook is not None
    assert (hook.config.budget, hook.config.seq_bucket, hook.config.ilp_time_limit_s) == ("1GB", None, 0.3)
    plugin = RematPlugin(budget="2GB", seq_bucket=64)
    assert plugin.to_config().seq_bucket == 64 and plugin.ilp_time_limit_s == 0.3
    with pytest.raises(RematError, match="already has a RematHook"):
        remat_accelerate.prepare(Accelerator(cpu=True), model, budget="1GB")
    with pytest.raises(RematError, match="unknown option.*'bugdet'"):
        remat_accelerate.prepare(Accelerator(cpu=True), _gpt2(), bugdet="1GB")


def test_hf_gradient_checkpointing_is_turned_off_and_checkpoint_wrappers_keep_remat_off(caplog):
    """HF's per-layer checkpointing is switched off with a warning; CheckpointWrapper modules leave us off."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = _gpt2()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        prepared = remat_accelerate.prepare(Accelerator(cpu=True), model, budget="1GB")
    assert "turning off gradient checkpointing" in caplog.text
    assert not find_double_checkpointing(model)[0] and find_hook(prepared) is not None

    wrapped = _gpt2()
    wrapped.transformer.h[0] = checkpoint_wrapper(wrapped.transformer.h[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        prepared = remat_accelerate.prepare(Accelerator(cpu=True), wrapped, budget="1GB")
    assert "CheckpointWrapper" in caplog.text and find_hook(prepared) is None


def test_mixed_precision_is_refused_with_the_fix():
    """Autocast steps are not bit-equal yet: prepare says so instead of training differently."""
    with pytest.raises(RematError, match="mixed_precision 'bf16' is not supported.*mixed_precision='no'"):
        remat_accelerate.prepare(Accelerator(cpu=True, mixed_precision="bf16"), _gpt2(), budget="1GB")


def test_remat_launch_rejects_a_bad_budget_in_one_line(capsys):
    """`remat launch --budget eighty ...` exits 2 with one line naming the accepted forms, before any launch."""
    assert cli.main(["launch", "--budget", "eighty", "--multi_gpu", str(EXAMPLE)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("remat launch: error: --budget 'eighty'") and "'12GiB'" in err and "'80%'" in err
    assert cli.main(["launch", "--budget", "80%"]) == 2  # no script
    assert cli.split_launch_args(["--budget=1GB", "--seq-bucket", "64", "--multi_gpu", "t.py", "--budget", "x"]) \
        == (["--budget=1GB", "--seq-bucket", "64"], ["--multi_gpu", "t.py", "--budget", "x"])


def test_remat_console_script_rejects_a_bad_budget():
    """The installed `remat` entry point: exit code 2 and a one-line message."""
    script = shutil.which("remat", path=str(Path(sys.executable).parent))
    command = [script] if script else [sys.executable, "-m", "remat_plugin.cli"]
    proc = subprocess.run([*command, "launch", "--budget", "eighty", "--multi_gpu", "--num_processes", "2",
                           str(EXAMPLE)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--budget 'eighty'" in proc.stderr and "'80%'" in proc.stderr


# --- auto batch size ------------------------------------------------------------------------------
AUTO_BUDGET = 8 * 2**20  # the tiny float64 GPT-2 at 64 tokens: AdamW's state to come leaves ~6 MiB, batch 4 fits


def _loader(rows: int = 16, batch_size: int = 2, **kwargs) -> DataLoader:
    tokens = torch.randint(0, 500, (rows, 64), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=batch_size, **kwargs)


def test_choose_batch_size_picks_the_largest_fitting_multiple_and_a_real_step_at_it_fits():
    """auto_batch_size on: a size above the script's, a multiple of multiple_of, whose next notch has no fitting plan;
    the rebuilt loader's first step at that size stays in the budget and reuses the plan made while verifying."""
    accelerator = Accelerator(cpu=True)
    model = remat_accelerate.prepare(accelerator, _gpt2(), budget=AUTO_BUDGET, ilp_time_limit_s=ILP_S,
                                     auto_batch_size=True, multiple_of=2)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = _loader(shuffle=True)
    (first,) = next(iter(loader))
    model.eval()  # as from_pretrained leaves it: the probe trains it for the while, then puts it back
    rng, weights = torch.get_rng_state(), {k: v.clone() for k, v in model.state_dict().items()}

    size = choose_batch_size(accelerator, model, ((), {"input_ids": first, "labels": first}), default=2)

    hook = find_hook(model)
    assert hook is not None and hook.session is not None
    choice = hook.batch_size_choice
    assert choice is not None and choice.batch_size == size and choice.objective == "max"
    assert size > 2 and size % 2 == 0, choice.summary()
    assert choice.budget_bytes < AUTO_BUDGET == parse_budget(hook.config.budget)  # less AdamW's state to come
    assert choice.next_size is not None and choice.next_size.batch_size == size + 2
    assert choice.next_size.predicted_time_ms is None and choice.next_size.min_feasible_bytes > choice.budget_bytes
    assert choice.trial_steps >= 1 and choice.measured_peak_bytes is not None
    assert choice.measured_peak_bytes <= choice.budget_bytes
    assert not model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    solved = hook.session.n_solved
    assert choose_batch_size(accelerator, model, ((), {"input_ids": first, "labels": first}), default=2) == size

    model.train()
    loader = rebuild_dataloader(accelerator, loader, size)
    (ids,) = next(iter(loader))
    assert ids.shape == (size, 64)
    with PeakMeter("cpu") as meter:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert meter.peak_bytes <= AUTO_BUDGET, (meter.peak_bytes, choice.summary())
    assert hook.session.n_solved == solved  # the verification step's plan, reused
    assert hook.session.plan is not None and hook.session.plan.predicted_peak_bytes <= choice.budget_bytes


@pytest.mark.parametrize("how", ["argument off", "env off", "no budget"])
def test_choose_batch_size_off_returns_the_default_and_plans_nothing(monkeypatch, how):
    """Without auto batch size (or without a budget, so without a hook) the default comes back untouched."""
    if how == "env off":
        monkeypatch.setenv("REMAT_AUTO_BATCH_SIZE", "0")
    options = {"auto_batch_size": False} if how == "argument off" else {}
    budget = None if how == "no budget" else AUTO_BUDGET
    if how == "no budget":
        monkeypatch.setenv("REMAT_AUTO_BATCH_SIZE", "1")
    accelerator = Accelerator(cpu=True)
    model = remat_accelerate.prepare(accelerator, _gpt2(), budget=budget, **options)
    ids = _ids(0)
    assert choose_batch_size(accelerator, model, ((), {"input_ids": ids, "labels": ids}), default=4) == 4
    hook = find_hook(model)
    if how == "no budget":
        assert hook is None
    else:
        assert hook is not None and hook.session is not None and hook.batch_size_choice is None
        assert hook.session.plans == {} and hook.session.n_solved == 0


@pytest.mark.parametrize("text, mode", [("1", "max"), ("TRUE", "max"), ("yes", "max"), ("max", "max"),
                                        ("throughput", "throughput"), ("0", None), ("false", None), ("no", None),
                                        ("", None)])
def test_remat_auto_batch_size_values(monkeypatch, text, mode):
    monkeypatch.setenv("REMAT_AUTO_BATCH_SIZE", text)
    monkeypatch.setenv("REMAT_BATCH_MULTIPLE_OF", "8")
    monkeypatch.setenv("REMAT_MAX_BATCH_SIZE", "64")
    plugin = RematPlugin(budget="1GB")
    assert (plugin.auto_batch_mode, plugin.multiple_of, plugin.max_val) == (mode, 8, 64)
    assert plugin.to_config().budget == "1GB"  # the batch size fields stay out of RematConfig
    assert RematPlugin(budget="1GB", auto_batch_size=True, multiple_of=4, max_val=None).auto_batch_mode == "max"


def test_invalid_remat_auto_batch_size_names_the_variable_and_the_values(monkeypatch):
    """REMAT_AUTO_BATCH_SIZE=eighty: prepare raises before anything is prepared; an explicit argument wins over it."""
    monkeypatch.setenv("REMAT_AUTO_BATCH_SIZE", "eighty")
    accelerator = Accelerator(cpu=True)
    with pytest.raises(ConfigError, match=r"REMAT_AUTO_BATCH_SIZE='eighty' is invalid.*1, true, yes or max.*"
                                          r"throughput.*0, false, no or empty.*unset it"):
        remat_accelerate.prepare(accelerator, _gpt2(), budget="1GB")
    assert accelerator._models == []
    with pytest.raises(ConfigError, match="REMAT_AUTO_BATCH_SIZE='eighty'"):
        RematPlugin()
    model = remat_accelerate.prepare(accelerator, _gpt2(), budget="1GB", auto_batch_size="throughput")
    assert find_hook(model).auto_batch_size == "throughput"  # type: ignore[union-attr]
    monkeypatch.delenv("REMAT_AUTO_BATCH_SIZE")
    monkeypatch.setenv("REMAT_BATCH_MULTIPLE_OF", "0")
    with pytest.raises(ConfigError, match=r"REMAT_BATCH_MULTIPLE_OF='0' is invalid: it must be a positive integer"):
        RematPlugin()
    monkeypatch.delenv("REMAT_BATCH_MULTIPLE_OF")
    with pytest.raises(ConfigError, match="auto_batch_size 'eighty' is not True, False, 'max' or 'throughput'"):
        RematPlugin(auto_batch_size="eighty")
    with pytest.raises(ConfigError, match=r"max_val 4 \(REMAT_MAX_BATCH_SIZE\) must be an integer >= multiple_of "
                                          r"\(8\)"):
        remat_accelerate.prepare(accelerator, _gpt2(), budget="1GB", multiple_of=8, max_val=4)


def test_rebuild_dataloader_keeps_the_dataset_sampler_and_options_from_a_plain_or_prepared_loader():
    """The new loader has the new batch size and the old one's shuffling, collate_fn, drop_last and workers; a
    prepared loader's base loader is rebuilt and the old one leaves the accelerator's list."""
    accelerator = Accelerator(cpu=True)

    def collate(rows):
        return torch.stack([r[0] for r in rows])

    plain = _loader(rows=20, batch_size=2, shuffle=True, collate_fn=collate, drop_last=True)
    for given in (plain, accelerator.prepare(plain)):
        before = list(accelerator._dataloaders)
        new = rebuild_dataloader(accelerator, given, 8)
        assert accelerator._dataloaders == [d for d in before if d is not given] + [new]
        base = new.base_dataloader
        assert base.dataset is plain.dataset and base.collate_fn is collate
        assert (base.num_workers, base.pin_memory, base.batch_sampler.drop_last) == (0, False, True)
        assert isinstance(base.batch_sampler.sampler, RandomSampler)
        batches = list(new)
        assert [b.shape for b in batches] == [(8, 64)] * 2  # 20 rows, drop_last
    ordered = rebuild_dataloader(accelerator, _loader(), 4)
    assert isinstance(ordered.base_dataloader.batch_sampler.sampler, SequentialSampler)
    assert torch.equal(next(iter(ordered))[0], _loader().dataset.tensors[0][:4])


# --- real launches: 2 CPU processes over gloo -------------------------------------------------------
EXAMPLE_ARGS = ["--cpu", "--dtype", "float64", "--steps", "3"]
MULTI = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"]


def _launch(tmp: Path, name: str, command: list[str], env_extra: dict[str, str] | None = None,
            args: list[str] = EXAMPLE_ARGS) -> list[dict]:
    """Run ``command`` (an accelerate or remat launch of the example) and read both ranks' JSON results."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REMAT_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp / "hf_home"), **(env_extra or {}))  # no user default config
    out = tmp / name
    proc = subprocess.run([*command, str(EXAMPLE), *args, "--json", str(out)], cwd=ROOT, env=env, check=False,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    results[0]["stdout"] = proc.stdout
    return results


def _accelerate() -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch"]


@pytest.fixture(scope="module")
def unmodified(tmp_path_factory) -> tuple[list[dict], int]:
    """Both ranks of the run without remat, and a budget of 65% of its largest step peak."""
    results = _launch(tmp_path_factory.mktemp("plain"), "plain", [*_accelerate(), *MULTI])
    assert [r["distributed_type"] for r in results] == ["DistributedType.MULTI_CPU"] * 2
    assert results[0]["plan"] is None and results[1]["plan"] is None
    return results, max(max(r["peaks"]) for r in results) * 65 // 100


def _check_same_plan_same_losses_within_budget(ours: list[dict], plain: list[dict], budget: int) -> None:
    assert [r["world_size"] for r in ours] == [2, 2] and ours[0]["pid"] != ours[1]["pid"]
    assert [r["n_solved"] for r in ours] == [1, 0]  # rank 0 plans, rank 1 receives
    assert ours[0]["plans"] == ours[1]["plans"] and len(ours[0]["plans"]) == 1
    plan = Plan.from_json(next(iter(ours[0]["plans"].values())))
    assert any(b.mode != "keep" for b in plan.blocks), plan.table()
    for mine, theirs in zip(ours, plain):
        assert mine["budget_bytes"] == budget
        assert mine["losses"] == theirs["losses"]
        assert max(mine["peaks"]) <= budget, (mine["peaks"], budget)
    assert ours[0]["losses"] != ours[1]["losses"]  # the ranks did see different data


@pytest.mark.slow
def test_accelerate_launch_with_remat_budget_env(unmodified, tmp_path):
    """REMAT_BUDGET=<bytes> accelerate launch (2 processes): one plan on both ranks, same losses, peaks in budget."""
    plain, budget = unmodified
    ours = _launch(tmp_path, "env", [*_accelerate(), *MULTI], {"REMAT_BUDGET": str(budget),
                                                               "REMAT_ILP_TIME_LIMIT_S": "0.3"})
    _check_same_plan_same_losses_within_budget(ours, plain, budget)


@pytest.mark.slow
def test_remat_launch_with_the_cpu_config_file(unmodified, tmp_path):
    """remat launch --budget B --config_file configs/accelerate_cpu.yaml: the same, through our CLI and the config."""
    plain, budget = unmodified
    script = shutil.which("remat", path=str(Path(sys.executable).parent))
    remat = [script] if script else [sys.executable, "-m", "remat_plugin.cli"]
    command = [*remat, "launch", "--budget", str(budget), "--ilp-time-limit-s", "0.3", "--config_file",
               str(ROOT / "configs" / "accelerate_cpu.yaml")]
    ours = _launch(tmp_path, "cli", command)
    _check_same_plan_same_losses_within_budget(ours, plain, budget)


@pytest.mark.slow
def test_accelerate_launch_with_remat_auto_batch_size(tmp_path):
    """REMAT_AUTO_BATCH_SIZE=1 REMAT_BATCH_MULTIPLE_OF=2 accelerate launch (2 processes): both ranks choose the same
    size above --batch-size, train at it with the plan made while verifying, and stay in the budget."""
    env = {"REMAT_BUDGET": str(AUTO_BUDGET), "REMAT_AUTO_BATCH_SIZE": "1", "REMAT_BATCH_MULTIPLE_OF": "2",
           "REMAT_ILP_TIME_LIMIT_S": str(ILP_S)}
    ours = _launch(tmp_path, "auto", [*_accelerate(), *MULTI], env,
                   args=["--cpu", "--dtype", "float64", "--steps", "4", "--batch-size", "2"])
    size = ours[0]["batch_size"]
    assert [r["batch_size"] for r in ours] == [size, size] and size > 2 and size % 2 == 0
    assert f"auto batch size: {size} per process (--batch-size 2)" in ours[0]["stdout"]
    assert ours[0]["batch_size_choice"] == ours[1]["batch_size_choice"] is not None
    assert [r["n_solved"] for r in ours] == [1, 0]  # rank 0 planned while verifying; training reused it
    assert ours[0]["plans"] == ours[1]["plans"] and len(ours[0]["plans"]) == 1
    for r in ours:
        assert r["budget_bytes"] == AUTO_BUDGET and r["batch_sizes"] and set(r["batch_sizes"]) == {size}
        assert max(r["peaks"]) <= AUTO_BUDGET and r["batch_size_trial_peak"] <= AUTO_BUDGET, r["peaks"]
