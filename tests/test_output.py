"""What planning prints with default logging: a plain script and a real Lightning run, in fresh processes.

The processes configure no logging (conftest's WARNING on ``remat_plugin`` does not reach them),
which is what a user's script does; tests/output_script.py holds the runs.
"""
from __future__ import annotations

import functools
import io
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^remat_plugin: planned Sequential for 512x128 float32 in \d+\.\d s: predicted peak 1\.\d\d MiB "
                     r"under a 2\.00 MiB budget \(0\.\d\d of the unmodified 2\.\d\d MiB\), 1\.\d\dx the unmodified "
                     r"step time, \d of 6 blocks recomputed$")


@functools.cache
def _stderr_by_case(mode: str) -> dict[str, list[str]]:
    """Run ``output_script.py mode`` with no logging set up; its stderr lines under each ``--- case`` marker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REMAT_")}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "output_script.py"), mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases: dict[str, list[str]] = {}
    for line in proc.stderr.splitlines():
        if line.startswith("--- "):
            cases[line[4:]] = []
        elif cases:
            cases[list(cases)[-1]].append(line)
    return cases


def _ours(lines: list[str]) -> list[str]:
    return [line for line in lines if "remat_plugin" in line or "AutoRemat" in line]


def test_plain_script_prints_one_summary_line_with_default_logging():
    """rematerialize() in a script that configures no logging: exactly one line on stderr, the plan's summary."""
    assert [bool(SUMMARY.match(line)) for line in _ours(_stderr_by_case("plain")["default"])] == [True]


def test_plain_script_with_verbose_false_prints_nothing():
    """rematerialize(..., verbose=False): nothing from remat_plugin on stderr."""
    assert _ours(_stderr_by_case("plain")["verbose=False"]) == []


def test_logging_configured_by_the_user_decides():
    """basicConfig after a first plan: our handler steps aside; root at WARNING hides the summary, at INFO it shows
    once, in the user's format (not twice)."""
    cases = _stderr_by_case("logging-configured")
    assert [bool(SUMMARY.match(line)) for line in _ours(cases["nothing configured"])] == [True]
    assert _ours(cases["root at WARNING"]) == []
    shown = [line for line in cases["root at INFO"] if "planned Sequential" in line]
    assert len(shown) == 1 and shown[0].startswith("user INFO remat_plugin.runtime.reporting: remat_plugin: planned")


@pytest.mark.slow
def test_lightning_fit_prints_the_summary_with_lightnings_messages():
    """Trainer.fit with AutoRemat and default logging: the rewrite and the plan summary, once each, on stderr next
    to Lightning's own lines."""
    pytest.importorskip("lightning")
    lines = _stderr_by_case("lightning")["verbose=True"]
    ours = _ours(lines)
    assert ours[0] == "AutoRemat: rewriting Lit.net (Sequential, 99,072 parameters), budget 2MiB"
    assert [bool(SUMMARY.match(line)) for line in ours[1:]] == [True], ours
    assert any("GPU available" in line for line in lines)  # Lightning's own logger, same stream


@pytest.mark.slow
def test_lightning_fit_with_verbose_false_prints_nothing():
    """AutoRemat(verbose=False): no rewrite line and no summary, while Lightning's own lines still show."""
    pytest.importorskip("lightning")
    lines = _stderr_by_case("lightning")["verbose=False"]
    assert _ours(lines) == [] and any("GPU available" in line for line in lines)


def test_summary_line_for_a_recomputing_plan_a_keep_all_plan_a_cached_plan_and_a_fallback():
    """One line each: the numbers against the unmodified step; "nothing is recomputed"; where a plan was loaded
    from; for a fallback, what runs instead (the reason is the warning's)."""
    import dataclasses

    from torch import nn

    from remat_plugin.ir.plan import BlockChoice, Plan
    from remat_plugin.runtime.reporting import summary_line
    from remat_plugin.runtime.signature import Call

    key = Call.of(nn.Linear(4, 4), (torch.zeros(8, 4),), {}).key
    mib = 2**20
    plan = Plan(budget_bytes=60 * mib, margin_bytes=0, predicted_peak_bytes=45 * mib, predicted_time_ms=112.0,
                baseline_peak_bytes=145 * mib, baseline_time_ms=100.0, min_feasible_bytes=30 * mib,
                blocks=(BlockChoice(0, 5, "keep", 0, 0.0), BlockChoice(1, 9, "recompute", 0, 1.0)),
                n_unique_blocks=2, signature=key)
    assert summary_line(plan, "Net", elapsed_s=12.34) == (
        "remat_plugin: planned Net for 8x4 float32 in 12.3 s: predicted peak 45.00 MiB under a 60.00 MiB budget "
        "(0.31 of the unmodified 145.00 MiB), 1.12x the unmodified step time, 1 of 2 blocks recomputed")
    keep_all = dataclasses.replace(plan, blocks=plan.blocks[:1])
    assert summary_line(keep_all, "Net", loaded_from="/tmp/plans") == (
        "remat_plugin: loaded the plan of Net for 8x4 float32 from /tmp/plans: the unmodified step fits (predicted "
        "peak 45.00 MiB under a 60.00 MiB budget); nothing is recomputed")
    fallback = dataclasses.replace(plan, fallback="torch.export failed; per-layer checkpointing of 'h' (4 layers)")
    assert summary_line(fallback, "Net") == (
        "remat_plugin: Net on 8x4 float32 could not be captured (see the warning): per-layer checkpointing of 'h' "
        "(4 layers); a metered step chooses how many are checkpointed under the 60.00 MiB budget")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _bar_output(monkeypatch) -> str:
    from remat_plugin.runtime.progress import PlanningProgress

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with PlanningProgress("planning Net") as progress:
        time.sleep(1.1)  # the bar waits a second: quick plans show nothing
        progress.stage("solve blocks, chain DP")
        progress(3, 6)
    return terminal.getvalue()


def test_progress_bar_on_a_terminal_only_with_rich_and_not_when_quieted(monkeypatch):
    """stderr a terminal: rich draws the stage; without rich, or with remat_plugin.progress above INFO, nothing."""
    monkeypatch.setattr(logging.getLogger("remat_plugin"), "level", logging.NOTSET)  # conftest's WARNING, undone
    assert "planning Net: solve blocks, chain DP" in _bar_output(monkeypatch)
    monkeypatch.setitem(sys.modules, "rich.progress", None)  # as if rich were not installed
    assert _bar_output(monkeypatch) == ""
    monkeypatch.delitem(sys.modules, "rich.progress")
    monkeypatch.setattr(logging.getLogger("remat_plugin.progress"), "level", logging.WARNING)  # remat plan --quiet
    assert _bar_output(monkeypatch) == ""
