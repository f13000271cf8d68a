"""Benchmark models: small, seeded, CPU-friendly stand-ins for the shapes remat sees in practice.

Every factory returns a :class:`BenchModel` in train mode. Two factories called with the same
``seed`` and ``dtype`` build identical modules, and ``make_batch(seed)`` is deterministic, so a
peer and its baseline can be compared bitwise.

The peers (``bench/peers.py``) rely on one convention, stated on :attr:`BenchModel.layers`: the
repeated layers run in order, each called as ``layer(hidden, *rest, **kwargs)`` with the previous
layer's output as ``hidden``, the same ``rest``/``kwargs`` for every layer, and returning the new
hidden tensor. That is what lets a peer checkpoint a run of several layers as one segment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat_plugin.bench.bench_model import Batch, BenchModel, generator, seeded
from remat_plugin.bench.model_families import llama_tiny, mistral_tiny, mixtral_tiny, padding_mask, t5_tiny, unet_tiny

__all__ = [
    "ALL_MODELS", "GPU_MODELS", "MODELS", "BenchModel", "bert_tiny", "build", "gpt2_small", "gpt2_tiny", "llama_tiny", "mistral_tiny", "mixtral_tiny", "mlp_chain", "resnet_tiny",
    "t5_tiny", "unet_tiny",
]  # fmt: skip

# --- gpt2-tiny ---------------------------------------------------------------------------------


def gpt2_tiny(
    n_layer: int = 4,
    batch_size: int = 8,
    seq_len: int = 256,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> BenchModel:
    """HF GPT-2 with random weights (never ``from_pretrained``): 256 wide, 4 heads, ``n_layer`` blocks.

    The vocabulary is cut to 1000 tokens so the LM head (seq x vocab logits) does not dwarf the
    blocks that remat works on; positions are capped at 256, the benchmark's sequence length.
    """
    return _gpt2("gpt2-tiny" if n_layer == 4 else f"gpt2-tiny-{n_layer}l", n_layer, 256, 4, 1000, 256,
                 batch_size, seq_len, dtype, seed, device)


def gpt2_small(
    n_layer: int = 12,
    batch_size: int = 8,
    seq_len: int = 1024,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cuda",
) -> BenchModel:
    """GPT-2 small's shape (124M parameters: 768 wide, 12 heads, GPT-2's 50,257-token vocabulary, 1024
    positions), random weights: a GPU-sized model, where kernels rather than per-op dispatch make the step."""
    return _gpt2("gpt2-small" if n_layer == 12 else f"gpt2-small-{n_layer}l", n_layer, 768, 12, 50257, 1024,
                 batch_size, seq_len, dtype, seed, device)


def _gpt2(
    name: str, n_layer: int, n_embd: int, n_head: int, vocab_size: int, n_positions: int,
    batch_size: int, seq_len: int, dtype: torch.dtype, seed: int, device: torch.device | str,
) -> BenchModel:
    from transformers import GPT2Config, GPT2LMHeadModel  # optional dependency; only this model needs it

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_positions=n_positions,
        vocab_size=vocab_size,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        use_cache=False,
        bos_token_id=vocab_size - 1,  # GPT-2's 50256 lies outside a cut vocabulary
        eos_token_id=vocab_size - 1,
    )
    if seq_len > config.n_positions:
        raise ValueError(f"bench.models: seq_len {seq_len} exceeds n_positions {config.n_positions}; lower seq_len.")
    with seeded(seed):
        module = GPT2LMHeadModel(config).to(device=device, dtype=dtype).train()  # type: ignore[call-arg]
    module.loss_type = "ForCausalLM"  # HF's default, named so it does not warn that none was set

    def make_batch(batch_seed: int) -> Batch:
        input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator(batch_seed))
        input_ids = input_ids.to(device)
        return (), {"input_ids": input_ids, "labels": input_ids}

    return BenchModel(
        name=name,
        module=module,
        make_batch=make_batch,
        loss=lambda output: output.loss,
        layers=list(module.transformer.h),
        hf_gradient_checkpointing=True,
        meta={"n_layer": n_layer, "batch_size": batch_size, "seq_len": seq_len, "vocab_size": vocab_size},
    )


# --- bert-tiny ---------------------------------------------------------------------------------


def bert_tiny(
    n_layer: int = 4,
    batch_size: int = 8,
    seq_len: int = 256,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> BenchModel:
    """HF BERT masked-LM with random weights (never ``from_pretrained``): 256 wide, 4 heads, ``n_layer`` layers.

    An encoder next to gpt2-tiny's decoder: bidirectional attention, post-LayerNorm, an MLM head
    (dense + GELU + LayerNorm before the decoder) whose activations the checkpointing peers never
    touch. The vocabulary is cut to 1000 tokens for the same reason as gpt2-tiny's. The batch
    masks 15% of the positions, as BERT pre-training does; only those carry a label. Sequences are
    padded at the end (``attention_mask``), as a collator pads a batch of uneven texts.
    """
    from transformers import BertConfig, BertForMaskedLM  # optional dependency; only this model needs it

    vocab_size = 1000
    mask_token_id = vocab_size - 1  # stands in for [MASK]; random input tokens are drawn below it
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=256,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        pad_token_id=0,
        use_cache=False,  # training: no cache (HF's checkpointing would turn it off with a warning)
    )
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"bench.models: seq_len {seq_len} exceeds max_position_embeddings {config.max_position_embeddings};"
            " lower seq_len."
        )
    with seeded(seed):
        module = BertForMaskedLM(config).to(device=device, dtype=dtype).train()  # type: ignore[call-arg]

    def make_batch(batch_seed: int) -> Batch:
        gen = generator(batch_seed)
        tokens = torch.randint(1, mask_token_id, (batch_size, seq_len), generator=gen)
        masked = torch.rand(batch_size, seq_len, generator=gen) < 0.15
        input_ids = torch.where(masked, torch.full_like(tokens, mask_token_id), tokens)
        attention_mask = padding_mask(batch_size, seq_len, gen)
        input_ids = torch.where(attention_mask.bool(), input_ids, torch.zeros_like(input_ids))  # 0: [PAD]
        labels = torch.where(masked & attention_mask.bool(), tokens, torch.full_like(tokens, -100))  # -100: ignored
        return (), {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
                    "labels": labels.to(device)}

    return BenchModel(
        name="bert-tiny" if n_layer == 4 else f"bert-tiny-{n_layer}l",
        module=module,
        make_batch=make_batch,
        loss=lambda output: output.loss,
        layers=list(module.bert.encoder.layer),
        hf_gradient_checkpointing=True,
        meta={"n_layer": n_layer, "batch_size": batch_size, "seq_len": seq_len, "vocab_size": vocab_size},
    )


def _labelled_batches(
    shape: tuple[int, ...], n_classes: int, dtype: torch.dtype, device: torch.device | str
) -> Callable[[int], Batch]:
    """``make_batch`` for ``forward(x, y)`` classifiers: seeded normal inputs of ``shape`` and class labels."""

    def make_batch(batch_seed: int) -> Batch:
        gen = generator(batch_seed)
        x = torch.randn(*shape, generator=gen, dtype=dtype).to(device)
        y = torch.randint(0, n_classes, (shape[0],), generator=gen).to(device)
        return (x, y), {}

    return make_batch


# --- mlp-chain ---------------------------------------------------------------------------------


class _ClassifierLoss(nn.Module):
    """``forward(x, y)`` returns the cross-entropy of ``head(body(x))`` against ``y``."""

    def __init__(self, body: nn.Sequential, head: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = head

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(self.body(x)), y)


def mlp_chain(
    n_blocks: int = 8,
    width: int = 512,
    batch_size: int = 256,
    n_classes: int = 10,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> BenchModel:
    """``n_blocks`` x (Linear(width, width) + GELU + Dropout(0.1)), a linear head, cross-entropy loss."""
    with seeded(seed):
        blocks = [nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1)) for _ in range(n_blocks)]
        module = _ClassifierLoss(nn.Sequential(*blocks), nn.Linear(width, n_classes))
    module = module.to(device=device, dtype=dtype).train()

    return BenchModel(
        name="mlp-chain",
        module=module,
        make_batch=_labelled_batches((batch_size, width), n_classes, dtype, device),
        loss=lambda output: output,
        layers=list(module.body),
        meta={"n_blocks": n_blocks, "width": width, "batch_size": batch_size},
    )


# --- resnet-tiny -------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv+BN, identity (or 1x1 conv+BN) shortcut, ReLU after the sum."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetTiny(nn.Module):
    """Stem conv+BN+ReLU, four basic blocks (16, 32, 64, 64 channels), global average pool, linear."""

    def __init__(self, n_classes: int = 10, widths: tuple[int, ...] = (16, 32, 64, 64)) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        blocks, in_channels = [], widths[0]
        for i, out_channels in enumerate(widths):
            blocks.append(BasicBlock(in_channels, out_channels, stride=1 if i == 0 else 2))
            in_channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_channels, n_classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))  # (B, 3, 32, 32) -> (B, 64, 4, 4)
        logits = self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))  # (B, n_classes)
        return F.cross_entropy(logits, y)


def resnet_tiny(
    batch_size: int = 8,
    image_size: int = 32,
    n_classes: int = 10,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> BenchModel:
    """:class:`ResNetTiny` on ``batch_size`` x 3 x 32 x 32 images; ``forward(x, y)`` returns the loss."""
    with seeded(seed):
        module = ResNetTiny(n_classes)
    module = module.to(device=device, dtype=dtype).train()

    return BenchModel(
        name="resnet-tiny",
        module=module,
        make_batch=_labelled_batches((batch_size, 3, image_size, image_size), n_classes, dtype, device),
        loss=lambda output: output,
        layers=list(module.blocks),
        meta={"batch_size": batch_size, "image_size": image_size},
    )


MODELS: dict[str, Callable[..., BenchModel]] = {
    "bert-tiny": bert_tiny,
    "gpt2-tiny": gpt2_tiny,
    "mlp-chain": mlp_chain,
    "resnet-tiny": resnet_tiny,
    "llama-tiny": llama_tiny,
    "mistral-tiny": mistral_tiny,
    "mixtral-tiny": mixtral_tiny,
    "t5-tiny": t5_tiny,
    "unet-tiny": unet_tiny,
}
# GPU-sized models: too big for the CPU tests that build every model in MODELS; the bench CLI takes them by name.
GPU_MODELS: dict[str, Callable[..., BenchModel]] = {"gpt2-small": gpt2_small}
ALL_MODELS: dict[str, Callable[..., BenchModel]] = {**MODELS, **GPU_MODELS}  # what build() and the CLI accept


def build(name: str, **kwargs: Any) -> BenchModel:
    """Build a benchmark model by name; ``kwargs`` go to its factory (``dtype``, ``seed``, sizes)."""
    if name not in ALL_MODELS:
        raise KeyError(f"bench.models: unknown model {name!r}; choose one of {sorted(ALL_MODELS)}.")
    return ALL_MODELS[name](**kwargs)
