"""Auto batch size against Lightning's BatchSizeFinder, on one model and one metered budget (reduced benchmark)."""
from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from remat_plugin.bench.batch_size_bench import format_report, run


@pytest.mark.slow
def test_planned_batch_size_beats_trial_and_error_and_the_next_size_does_not_fit():
    """≤ 3 trial steps for us, ≥ 1.5x BatchSizeFinder's size (it has no remat), our steps within B, and the next
    size up over B, within 1%, under its smallest feasible plan (predicted; measured within 5% of that)."""
    budget = 40 * 2**20
    r = run(budget, n_layer=2, n_embd=64, n_head=4, seq_len=128, multiple_of=4, pairs=1)
    theirs, ours, nxt = r["theirs"], r["ours"], r["next_size"]
    assert ours["trial_steps"] <= 3 < theirs["trial_steps"]
    # The search plans with every output held to the end of the step (the loop's use of the logits is seen only
    # at its first step), so it stops short of what a loss-only loop could take: 1.5x, not more, is the bar.
    assert ours["batch_size"] >= 1.5 * theirs["batch_size"], format_report(r)
    assert ours["training_step_peak_bytes"] <= budget
    assert nxt["batch_size"] == ours["batch_size"] + 4 * ours["trial_steps"]  # one notch down per back-off (tune.py)
    # The next size's smallest feasible plan is predicted over B, or at most 1% under it: that plan is solved again
    # in the benchmark's own planner, with time-limited block ILPs whose floor moves by a few tenths of a percent
    # between runs (README, "Known limits"; a loaded CI run found it 0.4% under B).  The allocator agrees with that
    # prediction within 5%.
    predicted, measured = nxt["predicted_peak_bytes"], nxt["measured_peak_bytes"]
    assert predicted > 0.99 * budget and abs(measured - predicted) <= 0.05 * predicted, (predicted, measured, budget)
    assert ours["samples_per_s"] > 0 and theirs["samples_per_s"] > 0
