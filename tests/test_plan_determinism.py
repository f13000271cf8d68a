"""Plans depend on the problem only (NOTE [work, not time] in remat_plugin.planning.solvers.pulp_backend): the same
``remat plan`` on meta, in separate processes, one of them beside two busy processes, gives the same schedule,
predicted peak and floor."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# gpt2 preset at 2 x 128 on meta: unmodified 37.47 MiB, smallest feasible 17.87 MiB; both budgets recompute.
BUDGETS = ("30MiB", "22MiB")
BUSY = "while True: pass"


def _plan(budget: str, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "remat_plugin.cli", "plan", "gpt2", "--batch-size", "2", "--seq-len", "128",
           "--device", "meta", "--budget", budget, "--quiet", "--json", str(out)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> None:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, (out[-2000:], err[-2000:])


@pytest.mark.slow
def test_the_same_plan_in_three_processes_one_beside_busy_ones(tmp_path):
    plans: dict[str, list[dict]] = {b: [] for b in BUDGETS}
    for run in range(3):
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(2)] if run == 2 else []
        try:
            procs = {b: _plan(b, tmp_path / f"{b}-{run}.json") for b in BUDGETS}
            for proc in procs.values():
                _finish(proc)
        finally:
            for p in busy:
                p.kill()
                p.wait()
        for b in BUDGETS:
            plans[b].append(json.loads((tmp_path / f"{b}-{run}.json").read_text()))
    for b, runs in plans.items():
        first = runs[0]
        assert first["reproducible"], b
        assert any(block["mode"] != "keep" for block in first["blocks"]), f"{b} recomputes nothing"
        for other in runs[1:]:
            assert other["reproducible"], b
            for key in ("schedule", "predicted_peak_bytes", "min_feasible_bytes", "predicted_time_ms", "blocks"):
                assert other[key] == first[key], (b, key)
