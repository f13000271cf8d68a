"""bf16 autocast and bf16 weights on CPU: the planned step computes what eager PyTorch computes, bit for bit.

The joint graph is traced under the caller's autocast, so the casts are ops of the graph and
recomputation replays them; the backward is traced the way eager runs it (after the autocast
block, or inside it once a step shows the caller does that), and dropout decomposes as eager's
CPU kernel (``torch_private.traced_like_eager``).  Plain PyTorch under the same autocast is the
oracle; the CPU allocator (profiler events) is the meter.
"""
import logging

import pytest
import torch
from budgets import settle, sweep, train_step

from remat_plugin import rematerialize
from remat_plugin.bench.models import build
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.runtime.signature import Signature

BF16 = {"device_type": "cpu", "dtype": torch.bfloat16}
MODELS = {"gpt2-tiny": {"n_layer": 2, "batch_size": 4, "seq_len": 128}, "llama-tiny": {"n_layer": 2}}


def _step(module, bench, batch, *, backward_inside=False, seed=7):
    """One training step under bf16 autocast, backward after the block (or inside it)."""
    args, kwargs = batch
    for p in bench.module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with torch.autocast(**BF16):
        loss = bench.loss(module(*args, **kwargs))
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return loss.detach()


def _grads(bench):
    return [p.grad.clone() for p in bench.module.parameters()]


def _assert_bitwise(loss, grads, loss_ref, grads_ref, label):
    assert torch.equal(loss, loss_ref), (label, loss, loss_ref)
    for i, (g, r) in enumerate(zip(grads, grads_ref)):
        assert torch.equal(g, r), (label, i, (g - r).abs().max())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_autocast_bitwise_and_under_budget_at_every_budget(name):
    """Dropout on, 6 budgets from the unmodified peak to the smallest feasible one: loss and every
    gradient bitwise equal to eager bf16 autocast, the allocator's peak within each budget."""
    bench = build(name, seed=0, **MODELS[name])
    batch = bench.make_batch(0)
    loss_ref = _step(bench.module, bench, batch)
    grads_ref = _grads(bench)
    with torch.autocast(**BF16):
        plan = rematerialize(bench.module, *batch, budget=10**12, verbose=False).plan
    assert "autocast cpu bfloat16" in Signature.from_key(plan.signature).describe()
    for i, budget in enumerate(sweep(plan)):
        with torch.autocast(**BF16):
            rm = rematerialize(bench.module, *batch, budget=budget, verbose=False)
        settle(lambda rm=rm: _step(rm, bench, batch))
        measured = measure_peak_profiler(lambda rm=rm: _step(rm, bench, batch))[1]
        assert measured <= budget, (i, measured, budget)
        _assert_bitwise(_step(rm, bench, batch), _grads(bench), loss_ref, grads_ref, f"budget {i}")


def test_autocast_is_part_of_the_signature():
    """A step planned under autocast is not replayed outside it, nor the reverse: each gets its own plan,
    and each matches eager PyTorch in its own precision."""
    bench = build("gpt2-tiny", seed=0, **MODELS["gpt2-tiny"])
    batch = bench.make_batch(0)
    args, kwargs = batch
    with torch.autocast(**BF16):
        rm = rematerialize(bench.module, *batch, budget=10**12, verbose=False)
    for p in bench.module.parameters():
        p.grad = None
    torch.manual_seed(3)
    loss_ref = bench.loss(bench.module(*args, **kwargs))
    loss_ref.backward()
    grads_ref = _grads(bench)
    for p in bench.module.parameters():
        p.grad = None
    torch.manual_seed(3)
    loss = bench.loss(rm(*args, **kwargs))  # no autocast: float32
    loss.backward()
    assert len(rm.steps) == 2
    _assert_bitwise(loss.detach(), _grads(bench), loss_ref.detach(), grads_ref, "float32 after a bf16 plan")


def test_backward_inside_autocast_is_learned(caplog):
    """A caller that runs backward() inside the autocast block (Lightning's manual optimization): the
    first such step is warned about, later steps are traced for it and equal eager bitwise."""
    bench = build("gpt2-tiny", seed=0, **MODELS["gpt2-tiny"])
    batch = bench.make_batch(0)
    loss_ref = _step(bench.module, bench, batch, backward_inside=True)
    grads_ref = _grads(bench)
    loss_after = _step(bench.module, bench, batch)
    assert any(not torch.equal(g, r) for g, r in zip(_grads(bench), grads_ref)), \
        "eager's gradients should depend on where backward runs here (the attention dropout's math path)"
    assert torch.equal(loss_after, loss_ref)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        with torch.autocast(**BF16):
            rm = rematerialize(bench.module, *batch, budget=10**12, verbose=False)
        _step(rm, bench, batch)  # metered first (calibration): its backward is ours, after the block
        assert "backward() ran" not in caplog.text
        _step(rm, bench, batch, backward_inside=True)
    assert caplog.text.count("backward() ran inside the torch.autocast block") == 1
    for _ in range(2):
        _assert_bitwise(_step(rm, bench, batch, backward_inside=True), _grads(bench), loss_ref, grads_ref,
                        "backward inside autocast")


def test_bf16_weights_with_dropout_bitwise():
    """A model in bf16 (Lightning's "bf16-true"), dropout on: eager CPU dropout multiplies by a bf16 noise
    tensor, which the trace reproduces (AOTAutograd's native_dropout would round the backward otherwise)."""
    bench = build("gpt2-tiny", seed=0, dtype=torch.bfloat16, **MODELS["gpt2-tiny"])
    batch = bench.make_batch(0)

    def step(module):
        return train_step(module, bench, batch, seed=5)

    loss_ref = step(bench.module)
    grads_ref = _grads(bench)
    plan = rematerialize(bench.module, *batch, budget=10**12, verbose=False).plan
    rm = rematerialize(bench.module, *batch, budget=(plan.baseline_peak_bytes + plan.min_feasible_bytes) // 2,
                       verbose=False)
    assert any(b.n_recomputed_ops for b in rm.plan.blocks), "a mid budget recomputes"
    settle(lambda: step(rm))
    _assert_bitwise(step(rm), _grads(bench), loss_ref, grads_ref, "bf16 weights")


def test_fp16_autocast_with_grad_scaler_scales_unscales_and_skips_inf_steps():
    """fp16 autocast with ``torch.amp.GradScaler`` (what "16-mixed" runs on GPUs; exercised here on CPU): a
    first scale so large the fp16 gradients overflow, so early steps are skipped and the scale halves.  The
    planned model's losses, scales and weights equal the unmodified model's, bitwise, after every step."""
    runs = []
    for planned in (False, True):
        bench = build("gpt2-tiny", seed=0, **MODELS["gpt2-tiny"])
        batch = bench.make_batch(0)
        args, kwargs = batch
        fp16 = {"device_type": "cpu", "dtype": torch.float16}
        module = bench.module
        if planned:
            with torch.autocast(**fp16):
                plan = rematerialize(bench.module, *batch, budget=10**12, verbose=False).plan
                module = rematerialize(bench.module, *batch, verbose=False,
                                       budget=(plan.baseline_peak_bytes + plan.min_feasible_bytes) // 2)
        optimizer = torch.optim.SGD(bench.module.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, backoff_factor=2.0**-4, growth_interval=100)
        record = []
        for step in range(5):
            torch.manual_seed(step)
            with torch.autocast(**fp16):
                loss = bench.loss(module(*args, **kwargs))
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            found_inf = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            record.append((loss.item(), found_inf, scaler.get_scale()))
        runs.append((record, [p.detach().clone() for p in bench.module.parameters()]))
    (plain, weights), (ours, weights_ours) = runs
    assert ours == plain, (ours, plain)
    assert plain[0][1] > 0 and plain[-1][1] == 0, plain  # overflowed steps were skipped, later ones taken
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_ours))


class Fp32Island(torch.nn.Module):
    """A model that turns autocast off for part of its forward (as Llama's rotary tables and many attention
    softmaxes do) and on again with another dtype for another part."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.fp16_layer = torch.nn.Linear(64, 64)  # its own weight: eager's cast cache keeps one dtype per weight
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = self.drop(torch.nn.functional.gelu(layer(x)))
            if i == 1:
                with torch.autocast("cpu", enabled=False):
                    x = torch.softmax(x.float() @ x.float().t(), dim=-1) @ x.float()
            if i == 2:
                with torch.autocast("cpu", dtype=torch.float16):
                    x = self.fp16_layer(x)
        return x.float().square().mean()


def test_autocast_changed_inside_the_forward_is_captured_as_it_runs():
    """Regions that turn autocast off, or switch its dtype, inside the forward: captured as they run, bitwise
    equal to eager at a budget that recomputes."""
    torch.manual_seed(0)
    model, x = Fp32Island(), torch.randn(256, 64)

    def step(module):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(2)
        with torch.autocast(**BF16):
            loss = module(x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss_ref, grads_ref = step(model)
    with torch.autocast(**BF16):
        plan = rematerialize(model, (x,), {}, budget=10**12, verbose=False).plan
        rm = rematerialize(model, (x,), {}, budget=(plan.baseline_peak_bytes + plan.min_feasible_bytes) // 2,
                           verbose=False)
    assert any(b.n_recomputed_ops for b in rm.plan.blocks)
    settle(lambda: step(rm))
    loss, grads = step(rm)
    _assert_bitwise(loss, grads, loss_ref, grads_ref, "autocast regions")
