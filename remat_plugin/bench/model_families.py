"""Benchmark models of today's families, each called the way users train it (padding masks, dropout).

- ``llama-tiny`` / ``mistral-tiny``: HF decoder-only LMs with rotary tables, grouped-query attention and
  an ``attention_mask`` that pads the end of some sequences.
- ``mixtral-tiny``: the same with a mixture of experts in each layer (4 experts, 2 per token, routed by
  transformers' ``grouped_mm`` experts, its default) and the router's load-balancing loss added, as MoE
  models are trained.
- ``t5-tiny``: HF T5 encoder-decoder: relative position bias, cross-attention over the encoder output,
  padding masks on both sides.
- ``unet-tiny``: a small conv U-Net with long skips (concatenated), BatchNorm and a Dropout2d bottleneck.

All random weights (never ``from_pretrained``), seeded like :mod:`remat_plugin.bench.models`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from remat_plugin.bench.bench_model import Batch, BenchModel, generator, seeded

VOCAB = 1000


def padding_mask(batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """1 for real tokens, 0 for padding at the end; the first row is full, the others keep half or more."""
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=gen)
    lengths[0] = seq_len
    return (torch.arange(seq_len)[None, :] < lengths[:, None]).long()


def _decoder_lm(family: str, n_layer: int, batch_size: int, seq_len: int, dtype: torch.dtype, seed: int,
                device: torch.device | str, **config_kwargs: Any) -> BenchModel:
    import transformers  # optional dependency; only these models need it

    config = getattr(transformers, f"{family}Config")(
        num_hidden_layers=n_layer, hidden_size=128, intermediate_size=344, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=max(256, seq_len), use_cache=False,
        attention_dropout=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=2, **config_kwargs,
    )
    with seeded(seed):
        module = getattr(transformers, f"{family}ForCausalLM")(config).to(device=device, dtype=dtype).train()

    def make_batch(batch_seed: int) -> Batch:
        gen = generator(batch_seed)
        input_ids = torch.randint(3, VOCAB, (batch_size, seq_len), generator=gen)
        mask = padding_mask(batch_size, seq_len, gen)
        labels = torch.where(mask.bool(), input_ids, torch.full_like(input_ids, -100))
        return (), {"input_ids": input_ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}

    name = f"{family.lower()}-tiny"
    return BenchModel(
        name=name if n_layer == 4 else f"{name}-{n_layer}l",
        module=module,
        make_batch=make_batch,
        loss=lambda output: output.loss,
        layers=list(module.model.layers),
        hf_gradient_checkpointing=True,
        meta={"n_layer": n_layer, "batch_size": batch_size, "seq_len": seq_len, "vocab_size": VOCAB},
    )


def llama_tiny(n_layer: int = 4, batch_size: int = 4, seq_len: int = 128, dtype: torch.dtype = torch.float32,
               seed: int = 0, device: torch.device | str = "cpu") -> BenchModel:
    """``LlamaForCausalLM``, 128 wide, 4 heads over 2 KV heads, padded batches."""
    return _decoder_lm("Llama", n_layer, batch_size, seq_len, dtype, seed, device)


def mistral_tiny(n_layer: int = 4, batch_size: int = 4, seq_len: int = 128, dtype: torch.dtype = torch.float32,
                 seed: int = 0, device: torch.device | str = "cpu") -> BenchModel:
    """``MistralForCausalLM`` with the same sizes as llama-tiny (sliding-window attention in its mask)."""
    return _decoder_lm("Mistral", n_layer, batch_size, seq_len, dtype, seed, device)


def mixtral_tiny(n_layer: int = 4, batch_size: int = 4, seq_len: int = 128, dtype: torch.dtype = torch.float32,
                 seed: int = 0, device: torch.device | str = "cpu", experts: str = "grouped_mm") -> BenchModel:
    """``MixtralForCausalLM`` with llama-tiny's sizes, 4 experts of 344 wide, 2 per token, the router's
    load-balancing loss in ``.loss`` (``output_router_logits=True``).

    ``experts`` is transformers' experts implementation: ``grouped_mm`` (its default) has no float64 kernel
    on the CPU; ``batched_mm`` has.
    """
    return _decoder_lm("Mixtral", n_layer, batch_size, seq_len, dtype, seed, device, num_local_experts=4,
                       num_experts_per_tok=2, output_router_logits=True, experts_implementation=experts)


def t5_tiny(n_layer: int = 2, batch_size: int = 4, seq_len: int = 128, dtype: torch.dtype = torch.float32,
            seed: int = 0, device: torch.device | str = "cpu") -> BenchModel:
    """``T5ForConditionalGeneration``: ``n_layer`` encoder and decoder blocks, 128 wide, dropout 0.1.

    Targets are half the source length; both sides are padded.
    """
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(  # type: ignore[call-arg]
        vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=344, num_layers=n_layer, num_decoder_layers=n_layer,
        num_heads=4, dropout_rate=0.1, use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    with seeded(seed):
        module = T5ForConditionalGeneration(config).to(device=device, dtype=dtype).train()  # type: ignore[call-arg]
    target_len = max(2, seq_len // 2)

    def make_batch(batch_seed: int) -> Batch:
        gen = generator(batch_seed)
        input_ids = torch.randint(2, VOCAB, (batch_size, seq_len), generator=gen)
        mask = padding_mask(batch_size, seq_len, gen)
        input_ids = torch.where(mask.bool(), input_ids, torch.zeros_like(input_ids))
        labels = torch.randint(2, VOCAB, (batch_size, target_len), generator=gen)
        labels = torch.where(padding_mask(batch_size, target_len, gen).bool(), labels, torch.full_like(labels, -100))
        kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
        return (), {k: v.to(device) for k, v in kwargs.items()}

    return BenchModel(
        name="t5-tiny" if n_layer == 2 else f"t5-tiny-{n_layer}l",
        module=module,
        make_batch=make_batch,
        loss=lambda output: output.loss,
        layers=[*module.encoder.block, *module.decoder.block],
        hf_gradient_checkpointing=True,
        meta={"n_layer": n_layer, "batch_size": batch_size, "seq_len": seq_len, "vocab_size": VOCAB},
        layers_chain=False,
    )


class ConvBlock(nn.Sequential):
    """Two 3x3 conv + BatchNorm + ReLU."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU(),
        )


class UNetTiny(nn.Module):
    """Encoder ``widths``, max-pool down, transposed-conv up, each level's skip concatenated on the way up.

    ``forward(x, y)`` returns the per-pixel cross-entropy against ``y``.
    """

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64), n_classes: int = 4) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        in_channels = 3
        for w in widths[:-1]:
            self.down.append(ConvBlock(in_channels, w))
            in_channels = w
        self.mid = nn.Sequential(ConvBlock(in_channels, widths[-1]), nn.Dropout2d(0.1))
        self.lift = nn.ModuleList()
        self.up = nn.ModuleList()
        for w_in, w in zip(widths[:0:-1], widths[-2::-1]):
            self.lift.append(nn.ConvTranspose2d(w_in, w, 2, stride=2))
            self.up.append(ConvBlock(2 * w, w))
        self.head = nn.Conv2d(widths[0], n_classes, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        skips = []
        for block in self.down:
            x = block(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for lift, block, skip in zip(self.lift, self.up, reversed(skips)):
            x = block(torch.cat([lift(x), skip], dim=1))
        return F.cross_entropy(self.head(x), y)


def unet_tiny(batch_size: int = 4, image_size: int = 64, n_classes: int = 4, dtype: torch.dtype = torch.float32,
              seed: int = 0, device: torch.device | str = "cpu") -> BenchModel:
    """:class:`UNetTiny` on ``batch_size`` x 3 x 64 x 64 images with per-pixel labels."""
    with seeded(seed):
        module = UNetTiny(n_classes=n_classes)
    module = module.to(device=device, dtype=dtype).train()

    def make_batch(batch_seed: int) -> Batch:
        gen = generator(batch_seed)
        x = torch.randn(batch_size, 3, image_size, image_size, generator=gen, dtype=dtype)
        y = torch.randint(0, n_classes, (batch_size, image_size, image_size), generator=gen)
        return (x.to(device), y.to(device)), {}

    return BenchModel(
        name="unet-tiny",
        module=module,
        make_batch=make_batch,
        loss=lambda output: output,
        layers=[*module.down, module.mid, *module.up],
        meta={"batch_size": batch_size, "image_size": image_size},
        layers_chain=False,
    )
