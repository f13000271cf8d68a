"""A batch held in a dataclass, and a dataclass the forward returns (NOTE [dataclass inputs and outputs]): planned
and bitwise, where ``torch.export`` refused both and the model fell back to per-layer checkpointing."""
import dataclasses

import torch
from budgets import assert_bitwise_at_a_recomputing_budget
from torch import nn


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    extra: dict  # nested: a dataclass inside a dict inside the batch


@dataclasses.dataclass(frozen=True)
class Weights:
    scale: torch.Tensor


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class _Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1),
                                                    nn.Linear(128, 32)) for _ in range(4)])
        self.head = nn.Linear(32, 3)

    def forward(self, batch: Batch) -> Output:
        logits = self.head(self.layers(batch.x)) * batch.extra["weights"].scale
        return Output(nn.functional.cross_entropy(logits, batch.y), logits)


def _batch(seed: int) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    return Batch(torch.randn(64, 32, generator=gen, dtype=torch.float64), torch.randint(0, 3, (64,), generator=gen),
                 {"weights": Weights(torch.rand(3, generator=gen, dtype=torch.float64))})


def test_a_dataclass_batch_and_output_plan_and_train_bitwise():
    rm = assert_bitwise_at_a_recomputing_budget(_Classifier().double(), [(_batch(i),) for i in range(3)])
    batch = _batch(5)
    out = rm(batch)
    assert type(out) is Output and out.logits.shape == (64, 3)
    assert len(rm._resolver.steps.seen) == 1  # one signature for every batch: not keyed by the tensors' values
