"""The Accelerate integration's options: RematPlugin, REMAT_* variables, prepare's arguments, and their errors
(in process, through the example script, and through `remat launch`)."""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
from accelerate import Accelerator
from accelerate.utils import DistributedType
from accelerate_helpers import EXAMPLE, ROOT, clean_env, tiny_gpt2

from remat_plugin import cli
from remat_plugin.errors import BudgetFormatError, RematError
from remat_plugin.integrations import accelerate as remat_accelerate
from remat_plugin.integrations.accelerate import RematPlugin, find_hook
from remat_plugin.runtime.config import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    yield from clean_env(monkeypatch)


def test_invalid_remat_budget_stops_prepare_naming_the_variable_and_the_forms(monkeypatch):
    """REMAT_BUDGET=eighty: prepare raises before anything is prepared, naming the variable and the accepted forms."""
    monkeypatch.setenv("REMAT_BUDGET", "eighty")
    accelerator = Accelerator(cpu=True)
    with pytest.raises(BudgetFormatError, match=r"REMAT_BUDGET='eighty'.*'12GiB'.*'80%'.*unset it"):
        remat_accelerate.prepare(accelerator, tiny_gpt2())
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
    model = tiny_gpt2()
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
    model = remat_accelerate.prepare(Accelerator(cpu=True), tiny_gpt2(), budget="1GB")
    hook = find_hook(model)
    assert hook is not None
    assert (hook.config.budget, hook.config.seq_bucket, hook.config.ilp_time_limit_s) == ("1GB", None, 0.3)
    plugin = RematPlugin(budget="2GB", seq_bucket=64)
    assert plugin.to_config().seq_bucket == 64 and plugin.ilp_time_limit_s == 0.3
    with pytest.raises(RematError, match="already has a RematHook"):
        remat_accelerate.prepare(Accelerator(cpu=True), model, budget="1GB")
    with pytest.raises(RematError, match="unknown option.*'bugdet'"):
        remat_accelerate.prepare(Accelerator(cpu=True), tiny_gpt2(), bugdet="1GB")


def test_fp8_mixed_precision_is_refused_naming_what_is_supported():
    """fp8 recipes (Transformer Engine, MS-AMP, torchao) are refused in one line; bf16 and fp16 are planned."""
    accelerator = types.SimpleNamespace(distributed_type=DistributedType.NO, mixed_precision="fp8")
    with pytest.raises(RematError, match="mixed_precision 'fp8' is not supported; use one of no, bf16, fp16"):
        remat_accelerate._check_supported(accelerator)


def test_fsdp1_and_deepspeed_are_refused_naming_the_fix():
    """FSDP1's flat parameters and DeepSpeed's engine are refused in one line; FSDP2 is planned (tests/test_fsdp.py)."""
    fsdp1 = types.SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False, mixed_precision="no")
    with pytest.raises(RematError, match="FSDP1 .* is not supported; set fsdp_version: 2"):
        remat_accelerate._check_supported(fsdp1)
    deepspeed = types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, is_fsdp2=False, mixed_precision="no")
    with pytest.raises(RematError, match="distributed_type DEEPSPEED is not supported"):
        remat_accelerate._check_supported(deepspeed)


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
        remat_accelerate.prepare(accelerator, tiny_gpt2(), budget="1GB")
    assert accelerator._models == []
    with pytest.raises(ConfigError, match="REMAT_AUTO_BATCH_SIZE='eighty'"):
        RematPlugin()
    model = remat_accelerate.prepare(accelerator, tiny_gpt2(), budget="1GB", auto_batch_size="throughput")
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
        remat_accelerate.prepare(accelerator, tiny_gpt2(), budget="1GB", multiple_of=8, max_val=4)

