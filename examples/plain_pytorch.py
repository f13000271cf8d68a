"""Train a tiny GPT-2 with remat_plugin in a plain PyTorch loop; print the plan and the memory saved.

    python examples/plain_pytorch.py [--budget 0.5] [--steps 5]

``--budget`` is a share of the unmodified step's measured peak (a real run would pass
bytes, "12GiB" or "80%" of free memory instead).
"""
from __future__ import annotations

import argparse
import logging

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from remat_plugin import rematerialize
from remat_plugin.capture.memory_meter import measure_peak
from remat_plugin.errors import human_bytes

VOCAB, BATCH_SIZE, SEQ_LEN = 1000, 8, 256


def tiny_gpt2() -> torch.nn.Module:
    """GPT-2 with random weights (seed 0): 4 blocks, 256 wide, 4 heads, a 1000-token vocabulary, dropout 0.1."""
    config = GPT2Config(n_layer=4, n_embd=256, n_head=4, n_positions=SEQ_LEN, vocab_size=VOCAB, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    with torch.random.fork_rng(devices=[]):  # seeded weights; the global RNG (dropout) is left as it was
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"  # HF's default, named so it does not warn that none was set
    return model


def make_batch(seed: int) -> tuple[tuple, dict]:
    """Random tokens as inputs and labels (the model shifts them): ``model(*args, **kwargs).loss``."""
    input_ids = torch.randint(0, VOCAB, (BATCH_SIZE, SEQ_LEN), generator=torch.Generator().manual_seed(seed))
    return (), {"input_ids": input_ids, "labels": input_ids}


def train_step(model, batch, optimizer) -> float:
    args, kwargs = batch
    optimizer.zero_grad(set_to_none=True)
    loss = model(*args, **kwargs).loss
    loss.backward()
    optimizer.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.5, help="share of the unmodified peak (default 0.5)")
    parser.add_argument("--steps", type=int, default=5)
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    model = tiny_gpt2()
    batch = make_batch(0)

    def unmodified_step():
        args, kwargs = batch
        model(*args, **kwargs).loss.backward()

    _, baseline_peak = measure_peak(unmodified_step)
    model.zero_grad(set_to_none=True)
    budget = int(baseline_peak * opts.budget)
    print(f"unmodified forward+backward peak: {human_bytes(baseline_peak)}; budget: {human_bytes(budget)}")

    rm = rematerialize(model, *batch, budget=budget)
    print(rm.plan.table())

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(opts.steps):
        batch = make_batch(step)
        loss, peak = measure_peak(lambda: train_step(rm, batch, optimizer))
        print(f"step {step}: loss {loss:.4f}  measured peak {human_bytes(peak)}"
              f"  (predicted {human_bytes(rm.plan.predicted_peak_bytes)}, budget {human_bytes(budget)})")
    saved = baseline_peak - peak
    print(f"memory saved: {human_bytes(saved)} ({saved / baseline_peak:.0%} of the unmodified peak)"
          f" at a predicted {rm.plan.predicted_overhead:.2f}x step time")


if __name__ == "__main__":
    main()
