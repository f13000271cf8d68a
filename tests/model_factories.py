"""Test models: ``module:factory`` pairs for ``remat plan`` tests (``factory(batch_size=, seq_len=) -> (module, args,
kwargs)``), and small models several test files share."""
from __future__ import annotations

import torch
from torch import nn


def mlp(batch_size: int, seq_len: int):
    """Four Linear+GELU layers over ``batch_size x seq_len`` rows of width 256, summed to a scalar."""
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (nn.Linear(256, 256), nn.GELU())]
    model = nn.Sequential(*layers)

    class SumLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = model

        def forward(self, x):
            return self.body(x).pow(2).mean()

    return SumLoss(), (torch.randn(batch_size * seq_len, 256),), {}


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
            return self.lin(x).sum()
        return self.lin(-x).sum()


def data_dependent(batch_size: int, seq_len: int):
    """A model ``torch.export`` cannot capture."""
    return _DataDependent(), (torch.randn(batch_size, seq_len, 8),), {}


def not_a_factory(batch_size: int, seq_len: int):
    return "nothing"


class TinyLM(nn.Module):
    """A language model whose logits (16 MiB at 32 x 64 tokens) outweigh everything else: its floors with the
    logits differentiated, held without a gradient, and dropped lie a logits tensor apart."""

    def __init__(self, vocab: int = 2048, hidden: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.body = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.body(self.emb(ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def gpt2_as_built(batch_size: int, seq_len: int):
    """A transformers GPT-2 with its config's defaults (``use_cache=True``), 2 small layers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=200, n_positions=max(64, seq_len)))
    ids = torch.randint(0, 200, (batch_size, seq_len))
    return model, (), {"input_ids": ids, "labels": ids}


class ResidualLayers(nn.Module):
    """``n`` residual layers ``x + Linear(Activation(Linear(x)))`` (a dropout before the second Linear when ``dropout``)
    in a ModuleList: repeated layers a fallback can checkpoint; subclasses write the forward around
    :meth:`residual`."""

    def __init__(self, width: int, hidden: int, n: int = 3, activation: type[nn.Module] = nn.Tanh,
                 dropout: float = 0.0):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden), activation(), *([nn.Dropout(dropout)] if dropout else []),
                          nn.Linear(hidden, width)) for _ in range(n))

    def residual(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x
