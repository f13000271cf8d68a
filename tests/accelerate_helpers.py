"""What the tests/test_accelerate_*.py files share: paths, the tiny GPT-2 and its inputs, a clean environment."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "accelerate_gpt2.py"
ILP_S = 0.2
AUTO_BUDGET = 8 * 2**20  # the tiny float64 GPT-2 at 64 tokens: AdamW's state to come leaves ~6 MiB, batch 4 fits


def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No REMAT_* from the caller's shell, and a fresh Accelerate state per test: an autouse fixture's body."""
    for var in [v for v in os.environ if v.startswith("REMAT_")]:
        monkeypatch.delenv(var)
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64, use_cache=False,
                        bos_token_id=499, eos_token_id=499)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).double().train()
    model.loss_type = "ForCausalLM"
    return model


def token_ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 500, (4, 64), generator=torch.Generator().manual_seed(seed))

