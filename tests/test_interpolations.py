"""NOTE [interpolations in the trace]: bilinear and bicubic resizes run eager's kernels in the planned step."""
import copy

import pytest
import torch
from budgets import step_grads
from torch import nn
from torch.nn import functional as F

from remat_plugin import InfeasibleBudgetError, rematerialize
from remat_plugin.ir.plan import budget_for_peak


class _Resizing(nn.Module):
    """Three blocks each upsampling by an odd factor and back down (a segmentation decoder's resizes)."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU(), nn.Dropout(0.1)) for _ in range(3))
        self.head = nn.Linear(4, 3)

    def forward(self, x, labels):
        for block in self.blocks:
            up = F.interpolate(block(x), size=(37, 33), mode=self.mode, align_corners=False)
            x = x + F.interpolate(up, size=x.shape[-2:], mode=self.mode, align_corners=False)
        return F.cross_entropy(self.head(x.mean((2, 3))), labels)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
def test_resizes_train_bitwise_at_a_recomputing_budget(mode):
    """Before: the trace ran torch._decomp's Python resize, float64 gradients ~1e-17 off eager's."""
    torch.manual_seed(0)
    model = _Resizing(mode).double()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(2, 4, 24, 27, dtype=torch.float64), torch.tensor([0, 2])) for _ in range(2)]
    plan = rematerialize(copy.deepcopy(model), batches[0], budget=10**12, verbose=False).plan
    with pytest.raises(InfeasibleBudgetError) as lowest:
        rematerialize(copy.deepcopy(model), batches[0], budget=1, verbose=False)
    budget = (budget_for_peak(plan.baseline_peak_bytes) + lowest.value.min_feasible_bytes) // 2
    rm = rematerialize(model, batches[0], budget=budget, verbose=False)
    assert not rm.plan.fallback and any(b.mode != "keep" for b in rm.plan.blocks)
    for ours, eager in zip(*(step_grads(m, batches, lambda loss: loss, 10) for m in (rm, reference))):
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))


def test_mobilevit_trains_bitwise():
    """transformers' MobileViT resizes its feature maps to fit the patch size (6e-13 off eager's before)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MobileViTConfig(image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                                          neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_labels=2)
    model = transformers.MobileViTForImageClassification(config).double().train()
    reference = copy.deepcopy(model)
    batch = {"pixel_values": torch.randn(2, 3, 30, 30, dtype=torch.float64), "labels": torch.tensor([0, 1])}
    rm = rematerialize(model, (), batch, budget=10**12, verbose=False)
    assert not rm.plan.fallback
    for m in (rm, reference):
        torch.manual_seed(3)
        m(**batch).loss.backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))


class _NearestDecoder(nn.Module):
    """A diffusers-style up block: a convolution, an attention-like mix over positions whose reshapes leave the
    feature map channels-last, a nearest 2x upsample, a convolution."""

    def __init__(self):
        super().__init__()
        self.conv_in, self.mix, self.conv_out = nn.Conv2d(4, 8, 3, padding=1), nn.Linear(8, 8), nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        b, c, height, width = h.shape
        mixed = self.mix(h.view(b, c, height * width).transpose(1, 2)).transpose(1, 2).reshape(b, c, height, width)
        h = (mixed + h) / 2  # laid out channels-last, as the reshape of the transpose is
        return self.conv_out(F.interpolate(h, scale_factor=2.0, mode="nearest")).pow(2).mean()


def test_nearest_upsampling_s_gradient_keeps_eager_s_layout():
    """Before: the trace's nearest upsample backward scattered into a row-major tensor where eager's kernel lays
    it out as the channels-last gradient, and the first convolution's bias gradient summed in another order."""
    torch.manual_seed(0)
    model = _NearestDecoder().double()
    reference = copy.deepcopy(model)
    batches = [(torch.randn(2, 4, 8, 8, dtype=torch.float64),) for _ in range(2)]
    rm = rematerialize(model, batches[0], budget=10**12, verbose=False)
    assert not rm.plan.fallback
    for ours, eager in zip(*(step_grads(m, batches, lambda loss: loss, 10) for m in (rm, reference))):
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))
