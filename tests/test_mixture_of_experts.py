"""Mixture-of-experts models as transformers builds them: planned and exact with its default experts, and a
clear fallback with the fix where its eager experts loop cannot be traced.

mixtral-tiny's budget sweep is in tests/test_model_families.py; the experts' profiled cost in
tests/test_profiled_inputs.py (NOTE [group offsets]).
"""
import copy
import logging

import pytest
import torch
from budgets import assert_bitwise_at_a_recomputing_budget, step_grads

from remat_plugin import rematerialize

transformers = pytest.importorskip("transformers")


def _qwen2_moe(**extra):
    """Qwen2-MoE: routed experts beside a shared expert with its own sigmoid gate, the router's loss in ``.loss``."""
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, output_router_logits=True, attention_dropout=0.1, use_cache=False, **extra)
    return transformers.Qwen2MoeForCausalLM(config).train()


def _batches():
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(3, 128, (2, 16), generator=gen)
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 11:] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches


def test_routed_and_shared_experts_train_bitwise_at_a_recomputing_budget(caplog):
    """float32: transformers' default experts (grouped products) have no float64 CPU kernel.  The router logits'
    recorders, hooks transformers installs at the first call, keep the layers from being traced once: said with
    that reason (it was a fake-tensor error from inside torch.export)."""
    model = _qwen2_moe()
    assert model.config._experts_implementation == "grouped_mm"
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        assert_bitwise_at_a_recomputing_budget(model, _batches())
    assert "could not be traced once (layer 0's " in caplog.text and "got hooks during the call" in caplog.text, caplog.text
    assert "fake tensor" not in caplog.text


def test_eager_experts_fall_back_per_layer_naming_the_experts_implementation(caplog):
    """The eager experts loop over the experts a batch routes to (``nonzero``): a data-dependent count."""
    model = _qwen2_moe(experts_implementation="eager")
    reference = copy.deepcopy(model)
    batches = _batches()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = rematerialize(model, (), batches[0], budget=10**12, verbose=False)
    assert 'experts_implementation="grouped_mm" or "batched_mm"' in rm.plan.fallback
    assert "per-layer checkpointing" in rm.plan.fallback and "budget" in caplog.text
    for ours, eager in zip(step_grads(rm, batches), step_grads(reference, batches)):
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))
