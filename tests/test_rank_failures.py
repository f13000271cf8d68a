"""Rank agreement in real `accelerate launch` runs (2 CPU processes, gloo): a fallback plan runs alike on both
ranks, and a failure on either rank while a step is made stops both with its message -- no hang, no gloo error."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
from accelerate_helpers import ROOT, clean_env

from remat_plugin.ir.plan import Plan

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "launch_scripts" / "rank_failures.py"
MESSAGE = "injected planning failure"  # the script's


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    yield from clean_env(monkeypatch)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """``REMAT_BUDGET=1GB accelerate launch`` of the script with 2 processes; the process and when it ended."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REMAT_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp / "hf_home"), REMAT_BUDGET="1GB")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(_free_port()), str(SCRIPT),
               "--json", str(tmp / "out"), *args]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    return proc, time.time()


def test_fallback_plan_is_agreed_and_run_alike_under_accelerate_launch(tmp_path):
    """An uncapturable model: rank 0's fallback plan is rank 1's too, both meter it alike and, with the budget's
    room, checkpoint no layer (NOTE [metered fallback]), and each rank's losses and the synchronised weights equal
    those of the same model trained without remat.  A last step where rank 1 sees a larger batch, which no plan
    covers: rank 1 plans its own fallback, the same again."""
    proc, _ = _launch(tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"out.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2 and r0["pid"] != r1["pid"]
    a0, a1 = r0["agreed"], r1["agreed"]
    assert (a0["n_solved"], a1["n_solved"]) == (1, 0)  # rank 0 plans, rank 1 receives
    assert a0["plans"] == a1["plans"] and len(a0["plans"]) == 1
    plan = Plan.from_json(next(iter(a0["plans"].values())))
    assert plan.fallback and "per-layer checkpointing of 'layers' (4 layers)" in plan.fallback
    assert all(b.mode == "keep" for b in plan.blocks) and 0 < plan.predicted_peak_bytes == plan.baseline_peak_bytes
    assert (r0["n_solved"], r1["n_solved"]) == (1, 1)  # the uneven step: rank 1 planned its own shapes
    for r, recomputed in ((r0, 0), (r1, 1)):
        assert r["losses"]["ours"] == r["losses"]["plain"] and len(r["losses"]["ours"]) == 4, r["losses"]
        # No layer recomputed where the metered step showed room; rank 1's own shapes, a step no other rank agreed
        # on, are not metered (as a planned step of its own shapes is not calibrated): every layer checkpointed.
        assert r["recomputed"] == {"ours": [recomputed] * 4, "plain": [0] * 4}, r["recomputed"]
        assert r["same_params"]
    assert r0["param_sum"] == r1["param_sum"]  # DDP kept the ranks in step
    assert r0["losses"]["ours"] != r1["losses"]["ours"]  # the ranks did see different data


@pytest.mark.parametrize(("inject", "failing", "doing"), [
    ("plan", 0, "planning"),
    ("budget", 1, "computing its budget"),
    ("replay", 1, "building its step of rank 0's plan"),
    ("own", 1, "planning its own input shapes"),
], ids=["rank0-planning", "rank1-budget", "rank1-replay", "rank1-own-shapes"])
def test_a_failure_while_making_a_step_stops_every_rank_with_its_message(tmp_path, inject, failing, doing):
    """A RuntimeError on one rank while the step is made: it raises there, the other rank raises a RematError with
    the same message, and both exit within 30 s of the failure."""
    proc, ended = _launch(tmp_path, "--inject", inject)
    assert proc.returncode != 0
    raised = {rank: tmp_path / f"out.rank{rank}.raised.json" for rank in (0, 1)}
    assert all(path.exists() for path in raised.values()), proc.stderr[-4000:]
    found = {rank: tuple(json.loads(path.read_text()).values()) for rank, path in raised.items()}
    assert found[failing][2] == f"RuntimeError: {MESSAGE}"
    assert found[1 - failing][2].startswith(f"RematError: remat_plugin: rank {failing} failed while {doing}: "
                                            f"RuntimeError: {MESSAGE}")
    for into_training_s, raised_at, _ in found.values():
        assert into_training_s < 30 and ended - raised_at < 30, (into_training_s, ended - raised_at)
    assert "Connection closed by peer" not in proc.stderr
