"""The training loop as users write it: retain_graph, double backward, parameters changed after planning,
the user's own dispatch modes and profiler around the first call.  Plain PyTorch is the oracle (float64)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from remat_plugin import InfeasibleBudgetError, rematerialize
from remat_plugin.bench.models import build
from remat_plugin.capture.output_usage import DoubleBackwardError
from remat_plugin.torch_private import TorchDispatchMode, pytree


def _mlp(n_layers: int = 4, width: int = 32) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(0.1)) for _ in range(n_layers)]
    return nn.Sequential(*layers, nn.Linear(width, 1)).double()


X = torch.randn(16, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {k: (None if p.grad is None else p.grad.clone()) for k, p in module.named_parameters()}


def _step(module: nn.Module, x: torch.Tensor = X, seed: int = 7) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = module(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def _at_floor(module: nn.Module, args: tuple, kwargs: dict | None = None, headroom: float = 1.0):
    """``module`` rematerialized at ``headroom`` times its smallest feasible budget (1: it recomputes all it can)."""
    try:
        return rematerialize(module, args, kwargs, budget=1, verbose=False)
    except InfeasibleBudgetError as err:
        budget = int(err.min_feasible_bytes * headroom)
        return rematerialize(module, args, kwargs, budget=budget, verbose=False)


def _assert_same_grads(ours: nn.Module, eager: nn.Module) -> None:
    a, b = _grads(ours), _grads(eager)
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] is None) == (b[k] is None), k
        if a[k] is not None:
            assert torch.equal(a[k], b[k]), k


# --- autograd ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_retain_graph_twice_gives_eager_gradients(name):
    """backward(retain_graph=True) then backward(): the planned step's gradients are eager's, bitwise."""
    sizes = {"n_layer": 2, "batch_size": 4, "seq_len": 64}  # activations outweigh the LM head's logits
    ours, eager = (build(name, dtype=torch.float64, seed=0, **sizes) for _ in range(2))
    args, kwargs = ours.make_batch(0)
    rm = _at_floor(ours.module, args, kwargs)
    assert any(b.mode != "keep" for b in rm.plan.blocks)  # something is recomputed in the retained backward
    for module, bench in ((rm, ours), (eager.module, eager)):
        torch.manual_seed(3)
        loss = bench.loss(module(*args, **kwargs))
        loss.backward(retain_graph=True)
        loss.backward()
    _assert_same_grads(ours.module, eager.module)


@pytest.mark.parametrize("dispatch", ["rematerialize", "session"])
def test_a_backward_through_an_eval_mode_call_is_said_once(caplog, dispatch):
    """NOTE [eval-mode backward]: eval-mode calls run unplanned (validation without no_grad plans nothing); a loop
    that trains in eval mode ran outside the budget silently, and is now told once, with the fix."""
    import logging

    from two_ranks import session_on

    model, eager = _mlp(), _mlp()
    if dispatch == "rematerialize":
        ours = rematerialize(model, (X,), budget=10**9, verbose=False)
    else:
        session_on(model)
        ours = model
    _step(ours)
    model.eval(), eager.eval()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        with torch.no_grad():
            ours(X)
        ours(X)  # a validation call that forgets no_grad: no backward, nothing said
        assert "eval mode" not in caplog.text
        for _ in range(2):
            _step(ours), _step(eager)
            _assert_same_grads(model, eager)  # the original's own step: dropout off
    assert caplog.text.count("backward() ran through a call of Sequential in eval mode") == 1, caplog.text
    assert "not bounded by the budget" in caplog.text and "call .eval() on those submodules" in caplog.text


def test_deterministic_algorithms_turned_on_after_planning_trains_bitwise():
    """A step traced before ``torch.use_deterministic_algorithms(True)`` raised in its backward (AOTAutograd
    checks the setting is as traced): the setting is part of the call's signature, so the call plans anew."""
    model, eager = _mlp(), _mlp()
    rm = _at_floor(model, (X,), headroom=1.2)
    _step(rm), _step(eager)
    _assert_same_grads(model, eager)
    try:
        torch.use_deterministic_algorithms(True)
        for seed in (8, 9):
            _step(rm, seed=seed), _step(eager, seed=seed)
            _assert_same_grads(model, eager)
    finally:
        torch.use_deterministic_algorithms(False)
    assert len(rm.steps) == 2
    _step(rm, seed=10), _step(eager, seed=10)  # the first step again
    _assert_same_grads(model, eager)
    assert len(rm.steps) == 2


def test_double_backward_raises_a_clear_error_at_the_call():
    """A gradient penalty needs create_graph=True: refused at that call, naming the limitation; plain grads work."""
    model = _mlp()
    rm = rematerialize(model, (X,), budget=10**9, verbose=False)
    x = X.clone().requires_grad_()
    out = rm(x).sum()
    with pytest.raises(DoubleBackwardError, match=r"create_graph=True.*not supported.*double backward"):
        torch.autograd.grad(out, x, create_graph=True)
    eager = _mlp()
    torch.manual_seed(3)
    (ours,) = torch.autograd.grad(rm(x).sum(), x)  # the same call without create_graph
    torch.manual_seed(3)
    (theirs,) = torch.autograd.grad(eager(x).sum(), x)
    assert torch.equal(ours, theirs)


# --- parameters changed after planning ------------------------------------------------------------
def test_unfreezing_after_planning_replans_and_trains_the_unfrozen_weight():
    model, eager = _mlp(), _mlp()
    for m in (model, eager):
        m[0][0].weight.requires_grad_(False)
    rm = _at_floor(model, (X,))
    _step(rm), _step(eager)
    assert model[0][0].weight.grad is None
    first = rm.plan
    for m in (model, eager):
        m[0][0].weight.requires_grad_(True)
    assert torch.equal(_step(rm), _step(eager))
    _assert_same_grads(model, eager)
    assert model[0][0].weight.grad is not None
    assert rm.plan is not first and rm.plan.planning_s > 0  # a new graph: planned afresh


def test_replaced_parameter_is_used_and_the_plan_is_replayed_not_resolved():
    model, eager = _mlp(), _mlp()
    rm = _at_floor(model, (X,))
    _step(rm), _step(eager)
    new = torch.randn_like(model[0][0].weight)
    model[0][0].weight = nn.Parameter(new.clone())
    eager[0][0].weight = nn.Parameter(new.clone())
    assert torch.equal(_step(rm), _step(eager))
    _assert_same_grads(model, eager)
    assert rm.plan.planning_s == 0.0  # same graph, new tensors: the plan is replayed on a new capture


def test_tied_weights_retied_after_planning():
    """``tie_weights``-style: the head's weight becomes the embedding's Parameter after the first step."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Embedding(50, 16)
            self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
            self.head = nn.Linear(16, 50, bias=False)

        def forward(self, ids):
            return self.head(self.body(self.emb(ids))).logsumexp(-1).mean()

    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    model, eager = Tied().double(), Tied().double()
    rm = rematerialize(model, (ids,), budget=10**9, verbose=False)
    for m in (rm, eager):
        m.zero_grad(set_to_none=True)
        m(ids).backward()
    for m in (model, eager):
        m.head.weight = m.emb.weight
    for m in (rm, eager):
        m.zero_grad(set_to_none=True)
        m(ids).backward()
    _assert_same_grads(model, eager)


class LowRank(nn.Module):
    """A hand-made LoRA adapter around a Linear: ``W x + B A x``, A and B trainable, W frozen."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(rank, base.in_features, dtype=base.weight.dtype) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank, dtype=base.weight.dtype) * 0.1)
        base.weight.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def test_hand_made_low_rank_adapter_added_after_step_one():
    model, eager = _mlp(), _mlp()
    rm = _at_floor(model, (X,), headroom=1.5)  # the adapter's weights and gradients need room too
    _step(rm), _step(eager)
    for m in (model, eager):
        torch.manual_seed(5)
        m[1][0] = LowRank(m[1][0])
    assert torch.equal(_step(rm), _step(eager))
    _assert_same_grads(model, eager)
    assert model[1][0].a.grad is not None and model[1][0].base.weight.grad is None


def test_peft_lora_added_after_step_one():
    peft = pytest.importorskip("peft")
    sizes = {"n_layer": 2, "batch_size": 2, "seq_len": 32}
    ours, eager = (build("gpt2-tiny", dtype=torch.float64, seed=0, **sizes) for _ in range(2))
    args, kwargs = ours.make_batch(0)
    rm = rematerialize(ours.module, args, kwargs, budget=10**10, verbose=False)
    for module, bench in ((rm, ours), (eager.module, eager)):
        torch.manual_seed(3)
        bench.loss(module(*args, **kwargs)).backward()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True,
                             init_lora_weights=False)
    for bench in (ours, eager):
        torch.manual_seed(11)
        peft.inject_adapter_in_model(config, bench.module)
        bench.module.zero_grad(set_to_none=True)
    for module, bench in ((rm, ours), (eager.module, eager)):
        torch.manual_seed(3)
        bench.loss(module(*args, **kwargs)).backward()
    _assert_same_grads(ours.module, eager.module)
    assert any("lora_" in k and p.grad is not None for k, p in ours.module.named_parameters())


# --- the user's tools around the first call ------------------------------------------------------
class StorageTracker(TorchDispatchMode):
    """What a memory tracker does: reads the address of every output (fails on fake tensors)."""

    def __init__(self):
        super().__init__()
        self.addresses: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.addresses.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("tool", ["flop_counter", "storage_tracker", "profiler"])
def test_first_training_call_inside_a_user_tool_plans_for_real(tool):
    """Capture and planning run with the user's modes suspended: a real plan, eager gradients, and the tool
    sees the step (a FLOP counter counts the same for the first step, planning included, as for the second)."""
    model, eager = _mlp(), _mlp()
    rm = None
    tools = {"flop_counter": lambda: FlopCounterMode(display=False), "storage_tracker": StorageTracker,
             "profiler": lambda: torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])}
    with tools[tool]() as first:
        rm = rematerialize(model, (X,), budget=10**9, verbose=False)
        _step(rm)
    assert rm.plan is not None and rm.plan.fallback is None
    _step(eager)
    _assert_same_grads(model, eager)
    if tool == "flop_counter":
        with FlopCounterMode(display=False) as second:
            _step(rm)
        assert first.get_total_flops() == second.get_total_flops() > 0
    if tool == "storage_tracker":
        assert first.addresses


def test_lazy_first_call_inside_a_dispatch_mode_plans_and_matches_eager():
    """A RematModule planning inside its first forward (no prepare) under a user's mode."""
    from remat_plugin.runtime.module import RematModule

    model, eager = _mlp(), _mlp()
    rm = RematModule(model, budget=10**9, verbose=False)
    with StorageTracker() as tracker:
        loss = _step(rm)
    assert rm.plan is not None and rm.plan.fallback is None and tracker.addresses
    assert torch.equal(loss, _step(eager))
    _assert_same_grads(model, eager)
