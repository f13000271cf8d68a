"""The Accelerate integration in real launches: `accelerate launch` and `remat launch`, 2 CPU processes over gloo."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
from accelerate_helpers import AUTO_BUDGET, EXAMPLE, ILP_S, ROOT, clean_env

from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.signature import describe


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    yield from clean_env(monkeypatch)


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
    # a rank replaying rank 0's plan is first run under our meter's profiler: its scratch is the plan's, unsaid
    assert "profiler session is recording" not in proc.stderr, proc.stderr[-4000:]
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
def test_accelerate_launch_mixed_precision_bf16(tmp_path):
    """accelerate launch --mixed_precision bf16 with REMAT_BUDGET (2 processes, float32 weights, dropout on): the
    planned step runs inside Accelerate's autocast, losses equal the run without remat bitwise, every step
    within the budget."""
    bf16 = [*_accelerate(), "--mixed_precision", "bf16", *MULTI]
    args = ["--cpu", "--dtype", "float32", "--steps", "3"]
    plain = _launch(tmp_path, "plain", bf16, args=args)
    budget = max(max(r["peaks"]) for r in plain) * 65 // 100
    ours = _launch(tmp_path, "ours", bf16, {"REMAT_BUDGET": str(budget), "REMAT_ILP_TIME_LIMIT_S": "0.3"}, args=args)
    _check_same_plan_same_losses_within_budget(ours, plain, budget)
    assert "(autocast cpu bfloat16)" in describe(next(iter(ours[0]["plans"])))


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

