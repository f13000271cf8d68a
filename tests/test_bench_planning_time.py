"""The planning-time benchmark's re-plans run within their budgets, metered at the allocator (reduced benchmark)."""
from __future__ import annotations

from remat_plugin.bench.planning_time import plan_in_order, unmodified_peak


def test_a_re_plan_at_a_new_shape_is_metered_within_its_budget():
    """Two shapes planned in one process (the second a re-plan on the first's caches), then one training step of
    each metered: both at or under the budget, each budget below the unmodified peak at that shape."""
    shapes = [{"n_layer": 2, "batch_size": 4, "seq_len": 64}, {"n_layer": 2, "batch_size": 4, "seq_len": 128}]
    plans = [(shape, int(unmodified_peak("gpt2-tiny", shape) * 0.75)) for shape in shapes]
    records = plan_in_order("gpt2-tiny", plans, meter=True)
    assert [r["shape"] for r in records] == shapes
    for record, (_, budget) in zip(records, plans):
        assert record["budget_bytes"] == budget
        assert 0 < record["measured_peak_bytes"] <= budget, record
        assert record["predicted_peak_bytes"] <= budget
