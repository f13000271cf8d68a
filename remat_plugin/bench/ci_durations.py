"""Where CI's time goes: the per-file test time of ``make test``'s runs, from their JUnit XML.

    python -m remat_plugin.bench ci-durations test-results/torch2.13.xml test-results/torch2.14.xml \
        [--wall-s 1712] [--commit SHA] [--json results/ci_durations_cpu.json]

``make test`` writes one XML file per run (``test-results/``).  For each run this sums the
time of every test (setup, call and teardown, as pytest reports it) per file, counts tests,
failures and skips, and prints the files longest first.  ``--wall-s``: the whole ``.ci/run``'s
wall time, measured outside, recorded beside the sums.  The JSON records the command, the
commit, the date, the machine and each run's torch.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def per_file(path: str) -> dict:
    """One JUnit XML file's tests summed per test file: ``{"files": {name: {"s", "tests"}}, "tests", ...}``."""
    root = ET.parse(path).getroot()
    files: dict[str, dict] = defaultdict(lambda: {"s": 0.0, "tests": 0})
    failed = skipped = 0
    for case in root.iter("testcase"):
        name = (case.get("classname") or "?").split(".")[-1] + ".py"
        files[name]["s"] += float(case.get("time") or 0.0)
        files[name]["tests"] += 1
        failed += case.find("failure") is not None or case.find("error") is not None
        skipped += case.find("skipped") is not None
    ordered = dict(sorted(((k, {"s": round(v["s"], 1), "tests": v["tests"]}) for k, v in files.items()),
                          key=lambda kv: -kv[1]["s"]))
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    wall = float(suite.get("time") or 0.0) if suite is not None else 0.0
    return {"xml": str(path), "wall_s": round(wall, 1), "tests": sum(v["tests"] for v in files.values()),
            "failed": failed, "skipped": skipped, "test_s": round(sum(v["s"] for v in files.values()), 1),
            "files": ordered}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m remat_plugin.bench ci-durations",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("xml", nargs="+", help="JUnit XML files written by make test (test-results/*.xml)")
    parser.add_argument("--wall-s", type=float, help="the whole .ci/run's wall time in seconds, measured outside")
    parser.add_argument("--top", type=int, default=15, help="files printed per run")
    parser.add_argument("--commit", help="the commit the runs tested (default: this checkout's HEAD)")
    parser.add_argument("--json", help="write the sums here")
    opts = parser.parse_args(argv)
    missing = [p for p in opts.xml if not Path(p).is_file()]
    if missing:
        parser.error(f"no such file {missing[0]!r}; `make test` writes test-results/torch2.13.xml and torch2.14.xml")
    runs = {Path(p).stem: per_file(p) for p in opts.xml}
    for name, run in runs.items():
        print(f"{name}: {run['tests']} tests ({run['failed']} failed, {run['skipped']} skipped), "
              f"{run['test_s']:.0f} s of tests in {run['wall_s']:.0f} s wall")
        for file, row in list(run["files"].items())[:opts.top]:
            print(f"  {row['s']:7.1f} s {row['tests']:4d}  {file}")
    if opts.json:
        record = {"command": "python -m remat_plugin.bench ci-durations " + " ".join(argv or sys.argv[1:]),
                  "commit": opts.commit or _commit(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
                  "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
                  "ci_wall_s": opts.wall_s, "runs": runs}
        Path(opts.json).write_text(json.dumps(record, indent=1))
        print(f"written to {opts.json}")
