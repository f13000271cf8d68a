"""``python -m remat_plugin.bench ci-durations``: per-file sums of make test's JUnit XML."""
from __future__ import annotations

import json

import pytest

from remat_plugin.bench.__main__ import main

XML = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="4" time="12.5">
<testcase classname="tests.test_a" name="test_one" time="1.25"/>
<testcase classname="tests.test_a" name="test_two" time="2.5"><failure message="boom"/></testcase>
<testcase classname="tests.test_b" name="test_three" time="7.0"/>
<testcase classname="tests.test_b" name="test_four" time="0.0"><skipped message="no GPU"/></testcase>
</testsuite></testsuites>
"""


def test_sums_per_file_longest_first_with_failures_skips_and_metadata(tmp_path, capsys):
    xml, out = tmp_path / "torch2.13.xml", tmp_path / "durations.json"
    xml.write_text(XML)
    assert main(["ci-durations", str(xml), "--wall-s", "100", "--commit", "abc123", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    run = record["runs"]["torch2.13"]
    assert list(run["files"]) == ["test_b.py", "test_a.py"]
    assert run["files"]["test_a.py"] == {"s": 3.8, "tests": 2} and run["files"]["test_b.py"] == {"s": 7.0, "tests": 2}
    assert (run["tests"], run["failed"], run["skipped"], run["wall_s"], run["test_s"]) == (4, 1, 1, 12.5, 10.8)
    assert record["ci_wall_s"] == 100 and record["commit"] == "abc123" and {"command", "date", "machine"} <= set(record)
    assert "4 tests (1 failed, 1 skipped), 11 s of tests in 12 s wall" in capsys.readouterr().out


def test_a_missing_file_names_where_make_test_writes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["ci-durations", "test-results/none.xml"])
    assert exc.value.code == 2 and "`make test` writes test-results/torch2.13.xml" in capsys.readouterr().err
