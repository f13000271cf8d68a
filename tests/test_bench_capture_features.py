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


def test_output_liveness_baseline_keeps_the_first_plans_outputs_and_both_variants_are_exact():
    """``output-liveness`` at 0.6 of the peak: the package's plan frees the dropped logits, the baseline (inside
    ``outputs_planned_as_first``) keeps its first plan's outputs; both within the budget, gradients bitwise."""
    r = run("gpt2-tiny", 0.6, pairs=1, feature="output-liveness")
    freed, kept = r["variants"]["freed"], r["variants"]["kept"]
    assert freed["dropped_outputs"] and not kept["dropped_outputs"] and not kept["ungraded_outputs"]
    for variant in (freed, kept):
        assert variant["within_budget"] and variant["grads_bitwise"], variant
