"""Mixed precision on CUDA: bf16 autocast, fp16 autocast with a GradScaler, Lightning's ``16-mixed`` in ``Trainer.fit``.

On the GPU, attention runs fused SDPA kernels whose backward accumulates with atomics (flash and
memory-efficient attention), so eager PyTorch does not repeat its own gradients bit for bit.  The oracle is
therefore eager under the same autocast, within a relative error that a wrong gradient (a missed term, a stale
recomputation) exceeds by orders of magnitude; eager's own spread is printed beside ours.  Budgets are kept
by ``max_memory_allocated``.  The lowest budgets sit above the planner's floor: a plan's first metered step
holds its outputs, which on CUDA measured a few MiB above the prediction (README, Known limits), and
``test_cuda.py``'s float32 test covers the floor itself.
"""
import sys
from pathlib import Path

import pytest
import torch
from budgets import settle, sweep

from remat_plugin import rematerialize
from remat_plugin.bench.models import build
from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.runtime.signature import describe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODELS = {"gpt2-tiny": {"n_layer": 2, "batch_size": 4, "seq_len": 128}, "llama-tiny": {"n_layer": 2}}
BF16 = {"device_type": "cuda", "dtype": torch.bfloat16}
FP16 = {"device_type": "cuda", "dtype": torch.float16}
MAX_REL_ERR = 2e-2  # per-gradient relative error (Frobenius norm) in bf16/fp16 arithmetic


def _step(module, bench, batch, autocast, seed=7):
    args, kwargs = batch
    for p in bench.module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    with torch.autocast(**autocast):
        loss = bench.loss(module(*args, **kwargs))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in bench.module.parameters()]


def _peak(module, bench, batch, autocast):
    bench.module.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with PeakMeter("cuda") as meter:
        _step(module, bench, batch, autocast)
    return meter.peak_bytes


def _rel_err(grads, reference):
    return max(((g.double() - r.double()).norm() / r.double().norm().clamp_min(1e-30)).item()
               for g, r in zip(grads, reference))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_autocast_within_budget_and_eager_gradients(name):
    """Dropout on, bf16 autocast on CUDA, three budgets down to near the floor: every metered step within its
    budget, the loss equal to eager's and each gradient within MAX_REL_ERR of eager's."""
    bench = build(name, seed=0, device="cuda", **MODELS[name])
    ref = build(name, seed=0, device="cuda", **MODELS[name])
    batch = bench.make_batch(0)
    loss_ref, grads_ref = _step(ref.module, ref, batch, BF16)
    _, grads_again = _step(ref.module, ref, batch, BF16)
    eager_spread = _rel_err(grads_again, grads_ref)
    with torch.autocast(**BF16):
        plan = rematerialize(bench.module, *batch, budget=10**12, verbose=False).plan
    assert "autocast cuda bfloat16" in describe(plan.signature)
    rows = []
    for i, budget in enumerate(sweep(plan, n=5)[:-1]):
        with torch.autocast(**BF16):
            rm = rematerialize(bench.module, *batch, budget=budget, verbose=False)
        settle(lambda rm=rm: _step(rm, bench, batch, BF16))
        measured = _peak(rm, bench, batch, BF16)
        loss, grads = _step(rm, bench, batch, BF16)
        rows.append((i, budget, measured, rm.plan.predicted_peak_bytes, bool(torch.equal(loss, loss_ref)),
                     _rel_err(grads, grads_ref)))
    print(f"{name} bf16 (budget, measured, predicted, loss equal, gradient rel. error); eager's own spread "
          f"{eager_spread:.2e}:", rows)
    assert all(measured <= budget for _, budget, measured, *_ in rows), rows
    for _, _, _, _, _, err in rows:
        assert err <= MAX_REL_ERR, rows
    torch.testing.assert_close(loss, loss_ref, rtol=1e-3, atol=0)


def test_fp16_autocast_with_grad_scaler_on_cuda():
    """fp16 autocast with ``torch.amp.GradScaler("cuda")`` (what Lightning's ``16-mixed`` runs): a first scale
    so large that the fp16 gradients overflow, so early steps are skipped and the scale backs off.  The
    planned model skips the same steps and reaches the same scales as the unmodified one, its losses and
    weights within fp16 tolerance, every step within the budget."""
    runs = []
    for planned in (False, True):
        bench = build("gpt2-tiny", seed=0, device="cuda", **MODELS["gpt2-tiny"])
        batch = bench.make_batch(0)
        args, kwargs = batch
        module, budget = bench.module, None
        if planned:
            with torch.autocast(**FP16):
                plan = rematerialize(bench.module, *batch, budget=10**12, verbose=False).plan
                budget = (plan.baseline_peak_bytes + plan.min_feasible_bytes) // 2
                module = rematerialize(bench.module, *batch, budget=budget, verbose=False)
        optimizer = torch.optim.SGD(bench.module.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0**24, backoff_factor=2.0**-4, growth_interval=100)
        record, peaks = [], []
        for step in range(6):
            torch.manual_seed(step)
            torch.cuda.manual_seed(step)
            torch.cuda.synchronize()
            with PeakMeter("cuda") as meter:
                with torch.autocast(**FP16):
                    loss = bench.loss(module(*args, **kwargs))
                scaler.scale(loss).backward()
            peaks.append(meter.peak_bytes)
            scaler.unscale_(optimizer)
            found_inf = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            record.append((loss.item(), found_inf > 0, scaler.get_scale()))
        runs.append((record, [p.detach().clone() for p in bench.module.parameters()], peaks, budget))
    (plain, weights, _, _), (ours, weights_ours, peaks, budget) = runs
    print("fp16 + GradScaler (loss, overflowed, scale) plain:", plain, "ours:", ours, "peaks:", peaks, "budget:", budget)
    assert [r[1:] for r in ours] == [r[1:] for r in plain], (ours, plain)
    assert plain[0][1] and not plain[-1][1], plain  # overflowed steps were skipped, later ones taken
    torch.testing.assert_close([r[0] for r in ours], [r[0] for r in plain], rtol=1e-3, atol=0)
    assert _rel_err(weights_ours, weights) <= 1e-3
    assert max(peaks[2:]) <= budget, (peaks, budget)  # the first two steps calibrate and learn the outputs' use


def test_lightning_16_mixed_fit_on_cuda_within_budget():
    """``Trainer(accelerator="gpu", precision="16-mixed")`` with ``AutoRemat`` at 0.6 of the run without it (dropout
    on, AdamW): each step after the first within the budget, the first loss equal, later ones close.  A fit's first
    step also allocates cuBLAS's workspaces, one-time blocks that the run without AutoRemat's first step has too
    (64 MiB on an H200: Lightning's teardown empties the cache, which releases them); the first step may exceed
    the budget by that much and no more."""
    pytest.importorskip("lightning")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from lightning_gpt2 import StepRecorder, load_options, train

    from remat_plugin.integrations.lightning import AutoRemat

    tiny = ["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.vocab_size=500", "model.n_positions=256",
            "data.batch_size=8", "data.seq_lens=[256]", "data.batches_per_len=4", "trainer.max_steps=4",
            "trainer.accelerator=gpu", "trainer.precision=16-mixed"]
    plain = StepRecorder()
    train(load_options(None, tiny), [plain])
    steady = max(plain.peaks[1:])
    one_time = plain.peaks[0] - steady  # the first step's workspaces
    budget = steady * 3 // 5
    ours = StepRecorder()
    auto = AutoRemat(budget=budget, ilp_time_limit_s=0.2)
    train(load_options(None, tiny), [auto, ours])
    print("16-mixed losses plain:", plain.losses, "ours:", ours.losses, "peaks:", ours.peaks, "budget:", budget,
          "unmodified peaks:", plain.peaks)
    assert auto.session is not None and any(b.n_recomputed_ops for p in auto.session.plans.values() for b in p.blocks)
    assert all(peak <= budget for peak in ours.peaks[1:]), (ours.peaks, budget)
    assert ours.peaks[0] <= budget + max(one_time, 0), (ours.peaks, budget, one_time)
    assert ours.losses[0] == plain.losses[0], (ours.losses, plain.losses)
    torch.testing.assert_close(ours.losses, plain.losses, rtol=1e-2, atol=0)
