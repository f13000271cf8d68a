"""The one-feature benchmarks run both variants within the budget, bitwise, and read each against the unmodified
step (reduced benchmark)."""
from __future__ import annotations

from remat_plugin.bench.capture_features import run


def test_dropout_masks_variants_are_metered_bitwise_and_timed_against_the_unmodified_step():
    """``dropout-masks`` at 0.6 of the peak, one timed round: both plans within the budget at the allocator,
    gradients bitwise the unmodified model's, and each variant's measured overhead read from the same round."""
    r = run("gpt2-tiny", 0.6, pairs=1, feature="dropout-masks")
    assert set(r["variants"]) == {"split", "whole"} and len(r["none_step_s"]) == 1
    for variant in r["variants"].values():
        assert variant["within_budget"] and variant["grads_bitwise"], variant
        assert variant["measured_overhead"] == variant["step_s"][0] / r["none_step_s"][0]
        assert variant["predicted_overhead"] >= 1.0
