"""The ``remat`` command as users run it: a subprocess, its output, its exit code."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REMAT = [sys.executable, "-m", "remat_plugin.cli"]
RECOMPUTED = re.compile(r"^\s+\d+\s+\d+\s+(recompute|checkpoint)\s", re.MULTILINE)  # a block row that recomputes


def _remat(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*REMAT, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def test_plan_on_cpu_and_meta_agree_and_json_renders_a_png(tmp_path):
    """The same preset planned with measured (cpu) and estimated (meta) costs: predicted peaks within 10%;
    the JSON plan round-trips into ``remat report``, which writes a PNG."""
    peaks = {}
    for device in ("cpu", "meta"):
        out = tmp_path / f"{device}.json"
        proc = _remat("plan", "gpt2", "--batch-size", "4", "--seq-len", "128", "--budget", "45MiB",
                      "--device", device, "--json", str(out), "--ilp-time-limit-s", "0.2")
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "predicted peak" in proc.stdout and "smallest feasible budget" in proc.stdout
        assert RECOMPUTED.search(proc.stdout)  # 45 MiB is well under the unmodified peak
        plan = json.loads(out.read_text())
        assert plan["predicted_peak_bytes"] <= plan["budget_bytes"] == 45 * 2**20
        peaks[device] = plan["predicted_peak_bytes"]
    assert abs(peaks["meta"] - peaks["cpu"]) <= 0.1 * peaks["cpu"], peaks
    proc = _remat("report", str(tmp_path / "meta.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    png = (tmp_path / "meta.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


@pytest.mark.parametrize(("args", "message"), [
    (["plan", "missing/config.json", "--budget", "1GiB"], "does not exist; give a preset (bert, gpt2"),
    (["plan", "gpt5", "--budget", "1GiB"], "unknown model preset 'gpt5'; give a preset (bert, gpt2"),
    (["plan", "gpt2", "--budget", "12", "GB"], "a budget is one word: '12GiB', not '12 GiB'"),
    (["plan", "gpt2", "--budget", "-5"], "cannot read budget '-5'; give bytes"),
    (["plan", "gpt2", "--budget", "eighty"], "cannot read budget 'eighty'; give bytes"),
    (["plan", "gpt2", "--budget", "80%", "--device", "meta"], "the meta device does not have; give a size"),
    (["report", "missing.json"], "cannot read plan 'missing.json'"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message, capsys):
    """Each user mistake gets exit code 2 and a single line that says what is accepted.  In-process (the entry point
    ``remat`` calls, ``cli.main``): a subprocess would spend its seconds importing torch; the exit code's way out of
    a real process is checked by test_plan_a_module_factory_and_name_a_bad_one."""
    from remat_plugin import cli

    code = cli.main(args)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    lines = [ln for ln in err.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
    assert len(lines) == 1 and message in lines[0], err


@pytest.mark.slow
def test_gpt2_medium_on_meta_plans_in_a_minute_under_2_gib():
    """24 layers, d=1024, seq 1024, batch 8 on ``--device meta``: under 60 s, peak RSS under 2 GiB."""
    probe = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(p.returncode, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "print(p.stdout[-3000:], p.stderr[-3000:])\n"
    )
    cmd = [sys.executable, "-c", probe, *REMAT, "plan", "gpt2-medium", "--batch-size", "8", "--seq-len", "1024",
           "--budget", "16GiB", "--device", "meta", "--quiet"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    code, seconds, rss_kib = proc.stdout.split("\n", 1)[0].split()
    assert code == "0", proc.stdout
    assert float(seconds) < 60, proc.stdout
    assert int(rss_kib) * 1024 < 2 * 2**30, proc.stdout
    assert "predicted peak" in proc.stdout


def test_plan_a_module_factory_and_name_a_bad_one():
    """``module:factory`` plans any module; a factory returning something else is named, exit code 2."""
    proc = _remat("plan", "tests.model_factories:mlp", "--batch-size", "8", "--seq-len", "128", "--budget", "6MiB",
                  "--ilp-time-limit-s", "0.2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "predicted peak" in proc.stdout and RECOMPUTED.search(proc.stdout)
    bad = _remat("plan", "tests.model_factories:not_a_factory", "--budget", "6MiB")
    assert bad.returncode == 2 and "must return (module, args, kwargs)" in bad.stderr


def test_plan_a_config_json_with_the_cache_on(tmp_path):
    """A config as the hub gives it (``use_cache`` left at transformers' default, True) plans on meta, and so does a
    factory's transformers model (on cpu): the CLI turns the key/value cache off, which a training step does not
    use and export cannot capture."""
    config = json.loads((ROOT / "remat_plugin" / "cli" / "presets" / "llama.json").read_text())
    del config["use_cache"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    proc = _remat("plan", str(path), "--batch-size", "2", "--seq-len", "64", "--budget", "1GiB", "--device", "meta",
                  "--ilp-time-limit-s", "0.2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "predicted peak" in proc.stdout and "could not capture" not in proc.stderr
    proc = _remat("plan", "tests.model_factories:gpt2_as_built", "--batch-size", "2", "--seq-len", "32", "--budget",
                  "1GiB", "--ilp-time-limit-s", "0.2")  # a factory's transformers model, the cache on
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "predicted peak" in proc.stdout and "could not capture" not in proc.stderr


def test_uncapturable_model_is_an_error_line_and_exit_code_2():
    """A model torch.export cannot capture ends ``remat plan`` with exit code 2 and our one-line error naming the
    model's line (after whatever torch itself logs), not a traceback."""
    proc = _remat("plan", "tests.model_factories:data_dependent", "--budget", "1GiB")
    assert proc.returncode == 2, (proc.stdout, proc.stderr[-2000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("remat plan: error: remat_plugin.capture: torch.export could not capture"), last
    assert "model_factories.py" in last and "Traceback" not in proc.stderr
