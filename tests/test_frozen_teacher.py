"""A frozen teacher inside the model (knowledge distillation): its no-gradient forward is a constant of the plan.

The teacher's ops mix the input with frozen weights only, so they are constants (NOTE [side values] in
planning/blocks.py) and join the one block that reads their output, the loss's.  That block then holds
many forward ops without being glued; it used to be warned about as glued, naming the loss's short-lived
values.
"""
import logging

import pytest
import torch
from budgets import assert_bitwise_at_a_recomputing_budget
from torch import nn

transformers = pytest.importorskip("transformers")


def _gpt2(n_layer: int) -> nn.Module:
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=256, n_positions=32,
                                     use_cache=False)
    return transformers.GPT2LMHeadModel(config)


class Distilled(nn.Module):
    """A student trained on its labels and on a frozen teacher's distribution, both called in one forward."""

    def __init__(self):
        super().__init__()
        self.teacher = _gpt2(3).eval().requires_grad_(False)
        self.student = _gpt2(4).train()

    def forward(self, input_ids, labels):
        with torch.no_grad():
            teacher = self.teacher(input_ids=input_ids).logits
        out = self.student(input_ids=input_ids, labels=labels)
        kl = nn.functional.kl_div(out.logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True,
                                  reduction="batchmean")
        return out.loss + kl


def test_a_frozen_teacher_is_exact_and_not_called_glue(caplog):
    torch.manual_seed(0)
    model = Distilled().double()
    gen = torch.Generator().manual_seed(1)
    batches = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 256, (4, 32), generator=gen)
                                                             for _ in range(2))]
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        rm = assert_bitwise_at_a_recomputing_budget(model, batches, loss=lambda out: out)
    assert len(rm.plan.blocks) >= 5  # the student's layers are blocks of their own
    assert not any("a block holds more than" in note for note in rm.plan.notes), rm.plan.notes
    assert "a block holds more than" not in caplog.text
