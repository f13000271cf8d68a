"""Budget parsing and the plan as plain data."""
import json

import pytest
import torch

from remat_plugin.errors import BudgetFormatError
from remat_plugin.ir.plan import BlockChoice, Plan, budget_for_peak, safety_margin
from remat_plugin.runtime.budget import parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [(300_000_000, 300_000_000), ("300MiB", 300 * 2**20), ("12GiB", 12 * 2**30), ("800MB", 800 * 10**6),
     ("1.5GiB", int(1.5 * 2**30)), ("4096", 4096)],
)
def test_budget_forms(text, expected):
    """Bytes, binary and decimal units are read exactly."""
    assert parse_budget(text) == expected


def test_percent_is_share_of_free_memory():
    """'50%' is half of what '100%' gives (free memory at plan time)."""
    full = parse_budget("100%", torch.device("cpu"))
    assert full > 0
    assert abs(parse_budget("50%") - full / 2) < 0.05 * full


@pytest.mark.parametrize("bad", ["eighty", "12 GB of RAM", "-5", -5, 0, "0%", "150%", True, [1]])
def test_bad_budgets_name_the_accepted_forms(bad):
    """Malformed budgets raise BudgetFormatError that names the accepted forms or the bound."""
    with pytest.raises(BudgetFormatError, match=r"remat_plugin: .*budget"):
        parse_budget(bad)


@pytest.mark.parametrize(("fraction", "share"), [(0.8, "80%"), ("0.8", "80%"), ("0.25", "25%")])
def test_a_fraction_is_refused_with_the_share_it_meant(fraction, share):
    """A budget under one byte (0.8, read as bytes, was 0) is refused, naming the share of memory meant."""
    with pytest.raises(BudgetFormatError, match=f"less than one byte; for a share of free memory write '{share}'"):
        parse_budget(fraction)


def test_margin_round_trip():
    """budget_for_peak gives the smallest budget whose usable part holds the peak."""
    for peak in [1, 10_000, 12_345_678, 3 * 2**30]:
        b = budget_for_peak(peak)
        assert b - safety_margin(b) >= peak
        assert (b - 1) - safety_margin(b - 1) < peak


def test_plan_json_round_trip_and_table():
    """A plan serialises to JSON and back unchanged, and prints a table with one row per block."""
    plan = Plan(
        budget_bytes=100, margin_bytes=1, predicted_peak_bytes=90, predicted_time_ms=11.0,
        baseline_peak_bytes=150, baseline_time_ms=10.0, min_feasible_bytes=50,
        blocks=(BlockChoice(0, 3, "keep", 10, 0.0), BlockChoice(1, 4, "recompute", 5, 1.0)),
        n_unique_blocks=2, schedule=("a", "b"),
    )
    text = plan.to_json()
    assert json.loads(text)["schema_version"] == 1
    assert Plan.from_json(text) == plan
    assert abs(plan.predicted_overhead - 1.1) < 1e-9
    assert len(plan.table().splitlines()) == 3 + 2
