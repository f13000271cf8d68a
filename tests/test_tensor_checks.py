"""NOTE [tensor checks]: a forward that checks tensor values (``torch._check_tensor_all``, transformers'
``torch_compilable_check``) is planned, exact, and still raises on a batch that fails the check."""
import copy

import pytest
import torch
from budgets import assert_bitwise_at_a_recomputing_budget
from torch import nn

from remat_plugin import rematerialize

transformers = pytest.importorskip("transformers")


class _CheckedIds(nn.Module):
    """Checks its ids before an embedding lookup, as a model guarding its vocabulary would."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 8), nn.GELU())

    def forward(self, ids):
        torch._check_tensor_all(ids < 16, lambda: "ids must be below the vocabulary size")
        return self.layers(self.embed(ids)).square().mean()


def test_a_checked_forward_plans_exact_and_still_checks():
    """Before: the check's read of a value failed the trace and, with no repeated layers, the capture."""
    torch.manual_seed(0)
    model = _CheckedIds().double()
    batches = [(torch.randint(0, 16, (64, 12)),) for _ in range(2)]
    rm = assert_bitwise_at_a_recomputing_budget(model, batches, loss=lambda loss: loss)
    with pytest.raises(ValueError, match=r"a check in the model's forward failed.*test_tensor_checks\.py"):
        rm(torch.full((64, 12), 3).index_fill(1, torch.tensor([5]), 16))  # one id out of range: same shapes


def _llava():
    """LLaVA: a CLIP vision tower's features scattered into a Llama's embeddings at the image tokens."""
    torch.manual_seed(0)
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, attention_dropout=0.1),
        text_config=transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=64, attention_dropout=0.1, use_cache=False),
        image_token_index=127, projector_hidden_act="gelu", vision_feature_layer=-1,
        vision_feature_select_strategy="full")
    return transformers.LlavaForConditionalGeneration(config).double().train()


def _llava_batch(image_tokens=17):
    """17 image tokens per image (16 patches and CLIP's class token), then text."""
    ids = torch.cat([torch.full((2, image_tokens), 127), torch.randint(3, 127, (2, 16))], 1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(ids == 127, -100),
            "pixel_values": torch.randn(2, 3, 32, 32, dtype=torch.float64)}


def test_llava_plans_exact_and_checks_its_image_tokens():
    """LLaVA checks its image tokens against its image features before ``masked_scatter``: it fell back to
    per-layer checkpointing.  A batch with a token short fails the check, as eager's does."""
    model = _llava()
    reference = copy.deepcopy(model)
    assert_bitwise_at_a_recomputing_budget(model, [_llava_batch(), _llava_batch()])
    rm = rematerialize(model, (), _llava_batch(), budget=10**12, verbose=False)
    short = _llava_batch()
    short["input_ids"][1, 16] = 5  # 16 image tokens in the second row, one image's features left over
    with pytest.raises(ValueError, match="Image features and image tokens do not match"):
        reference(**short)
    with pytest.raises(ValueError, match=r"a check in the model's forward failed.*modeling_llava\.py"):
        rm(**short)


class _CheckedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.dropout = nn.Linear(16, 64), nn.Linear(64, 16), nn.Dropout(0.1)

    def forward(self, x, mask):
        torch._check_tensor_all(mask.sum(-1) > 0, lambda: "each row needs a token")
        return x + self.down(self.dropout(torch.relu(self.up(x)))) * mask[..., None]


class _CheckedLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_CheckedLayer() for _ in range(4))

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return x.square().mean()


def test_checks_inside_repeated_layers_keep_them_traced_once(caplog):
    """A layer's check read a value while its fingerprint ran under export: the pending number failed the export
    of the model with opaque layers, and every layer was traced (said in the log)."""
    torch.manual_seed(0)
    model = _CheckedLayers().double()
    batches = [(torch.randn(8, 32, 16, dtype=torch.float64), torch.ones(8, 32, dtype=torch.float64))
               for _ in range(2)]
    with caplog.at_level("WARNING", logger="remat_plugin"):
        rm = assert_bitwise_at_a_recomputing_budget(model, batches, loss=lambda loss: loss)
    assert "could not be traced once" not in caplog.text
    x, mask = batches[0]
    with pytest.raises(ValueError, match=r"a check in the model's forward failed.*test_tensor_checks\.py"):
        rm(x, mask.index_fill(0, torch.tensor([3]), 0.0))
