"""NOTE [masks under export]: transformers encoders called without a padding mask plan bitwise eager's."""
import copy

import pytest
import torch
from budgets import assert_bitwise_at_a_recomputing_budget, step_grads

from remat_plugin import rematerialize

transformers = pytest.importorskip("transformers")


def _beit():
    """BEiT with its relative position bias, to which the exported model added transformers' all-True mask."""
    torch.manual_seed(0)
    config = transformers.BeitConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        num_labels=2, use_relative_position_bias=True, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
        drop_path_rate=0.1)
    return transformers.BeitForImageClassification(config).double().train()


def test_beit_relative_position_bias_trains_bitwise_at_a_recomputing_budget():
    """Before: gradients up to 2e-13 off eager's (float64), the bias's scores shifted by the mask's 1.0."""
    batches = [{"pixel_values": torch.randn(2, 3, 32, 32, dtype=torch.float64), "labels": torch.tensor([0, 1])}
               for _ in range(2)]
    assert_bitwise_at_a_recomputing_budget(_beit(), batches)


def test_a_padding_mask_is_still_built_under_export():
    """With a padding mask transformers' own check decides (it would read the mask's values otherwise): BERT
    with padding plans and trains bitwise."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64)
    model = transformers.BertForMaskedLM(config).double().train()
    reference = copy.deepcopy(model)
    ids = torch.randint(3, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    rm = rematerialize(model, (), batch, budget=10**12, verbose=False)
    assert not rm.plan.fallback
    for ours, eager in zip(step_grads(rm, [batch]), step_grads(reference, [batch])):
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))


def test_t5_decoder_without_a_mask_under_bf16_autocast_trains_bitwise():
    """The causal check (NOTE [masks under export]): T5's decoder called without a decoder mask ran SDPA on a
    per-batch-row mask holding its relative position bias, so under bf16 autocast the bias's gradient was summed
    over the batch after SDPA's bf16 backward, where eager sums it inside (1e-4 off); now eager's decision."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).train()
    reference = copy.deepcopy(model)
    ids = torch.randint(1, 64, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, 11:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids[:, :8].clone(), "use_cache": False}
    with torch.autocast("cpu", torch.bfloat16):
        rm = rematerialize(model, (), batch, budget=10**12, verbose=False)
    assert not rm.plan.fallback
    for m in (rm, reference):
        torch.manual_seed(3)
        with torch.autocast("cpu", torch.bfloat16):
            loss = m(**batch).loss
        loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
