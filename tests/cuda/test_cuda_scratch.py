"""Kernel scratch on CUDA is read from the host's range of each profiled op (NOTE [host ranges] in
``remat_plugin/capture/memory_meter.py``): the GPU's span of the same name, which runs later, put the host's next
allocations inside it, and a large-vocabulary loss's backward was given two logits of scratch (GPT-2 small at 8 x 1024:
3.07 GiB predicted above the measured peak)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.runtime.steps import capture_problem

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class LargeVocabularyHead(nn.Module):
    """A language model's head and loss: logits of 4096 x 32,000 (500 MiB in float32)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.proj = nn.Linear(64, 32000)

    def forward(self, x, labels):
        return F.cross_entropy(self.proj(self.norm(x)), labels)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return (torch.randn(4096, 64, device="cuda", generator=g),
            torch.randint(0, 32000, (4096,), device="cuda", generator=g))


def test_the_loss_ops_have_no_scratch_and_the_plan_predicts_the_measured_peak():
    torch.manual_seed(0)
    head = LargeVocabularyHead().cuda()
    x, labels = _batch()
    problem, _ = capture_problem(head, (x, labels))
    temps = {o.name: o.temp_bytes for o in problem.ops}
    elementwise = {n: t for n, t in temps.items() if n.startswith(("_log_softmax", "nll_loss", "add", "mul", "native_layer"))}
    assert elementwise and all(t == 0 for t in elementwise.values()), elementwise

    rm = rematerialize(head, (x, labels), budget=10**12)
    for _ in range(2):  # the first step of a plan is metered before it runs (NOTE [calibration])
        rm(x, labels).backward()
    head.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with PeakMeter("cuda") as meter:
        rm(x, labels).backward()
    predicted = rm.plan.predicted_peak_bytes
    assert abs(meter.peak_bytes - predicted) <= 0.05 * predicted, (meter.peak_bytes, predicted)
