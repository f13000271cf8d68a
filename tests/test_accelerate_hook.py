"""The Accelerate integration in process: RematHook on and off, composed with other hooks, gradients, save_state."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
from accelerate import Accelerator
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from accelerate_helpers import ILP_S, clean_env, tiny_gpt2, token_ids

from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.integrations import accelerate as remat_accelerate
from remat_plugin.integrations.accelerate import find_hook, plans_file
from remat_plugin.integrations.checkpointing import find_double_checkpointing


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    yield from clean_env(monkeypatch)


def _forced_budget(model, share: float = 0.6) -> int:
    """``share`` of the unmodified forward+backward peak: feasible, and only with recomputation."""
    probe = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]), PeakMeter("cpu") as meter:
        probe(input_ids=token_ids(0), labels=token_ids(0)).loss.backward()
    return int(meter.peak_bytes * share)


def _step(model, ids, seed: int):
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


class _CountingHook(ModelHook):
    """Another hook on the same module: ours must compose with it in either order."""

    def __init__(self):
        self.calls = 0

    def pre_forward(self, module, *args, **kwargs):
        self.calls += 1
        return args, kwargs



def test_gradients_bitwise_equal_to_the_unmodified_model_under_a_budget_that_forces_recomputation():
    """float64, dropout on, two steps: losses and gradients equal the model without the hook, bit for bit."""
    plain, ours = tiny_gpt2(), tiny_gpt2()
    budget = _forced_budget(plain)
    model = remat_accelerate.prepare(Accelerator(cpu=True), ours, budget=budget, ilp_time_limit_s=ILP_S)
    hook = find_hook(model)
    assert hook is not None and hook.session is not None
    for step in range(2):
        want, got = _step(plain, token_ids(step), seed=step), _step(model, token_ids(step), seed=step)
        assert torch.equal(want, got)
        for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
            assert torch.equal(p.grad, q.grad), name
    plan = hook.session.plan
    assert hook.session.n_solved == 1 and plan is not None and plan.budget_bytes == budget
    assert any(b.mode != "keep" for b in plan.blocks), plan.table()


def test_removing_the_hook_restores_forward_and_keeps_state_dict_keys():
    """Appended after another hook and before a third, the hook plans; remove_hook_from_module undoes all of it."""
    model, reference = tiny_gpt2(), tiny_gpt2()
    keys = list(model.state_dict())
    first, last = _CountingHook(), _CountingHook()
    add_hook_to_module(model, first)
    prepared = remat_accelerate.prepare(Accelerator(cpu=True), model, budget=10**12, ilp_time_limit_s=ILP_S)
    add_hook_to_module(model, last, append=True)  # Accelerate detaches and re-inits ours: its plans stay
    hook = find_hook(prepared)
    assert hook is not None and hook.attached
    _step(prepared, token_ids(0), seed=0)
    calls = first.calls
    assert calls == last.calls == 1  # planning's capture calls the real forward, not the hooks around ours again
    # the loss was kept, the logits dropped: planned again, tracing the first capture's export (no second export)
    _step(prepared, token_ids(0), seed=0)
    assert hook.session is not None and hook.session.n_solved == 1 and hook.session.resolver.n_refined == 1
    assert first.calls == last.calls == calls + 1
    calls = first.calls
    _step(prepared, token_ids(0), seed=0)
    assert first.calls == last.calls == calls + 1 and hook.session.resolver.n_refined == 1
    assert list(model.state_dict()) == keys

    remove_hook_from_module(model)
    assert not hook.attached and find_hook(model) is None
    assert "_hf_hook" not in model.__dict__ and "_old_forward" not in model.__dict__
    assert model.forward.__func__ is type(model).forward and model.forward.__self__ is model
    assert list(model.state_dict()) == keys
    reference.load_state_dict(model.state_dict())
    assert torch.equal(_step(model, token_ids(1), seed=1), _step(reference, token_ids(1), seed=1))
    assert hook.session.n_solved == 1 and first.calls == calls + 1  # the call went straight to the original forward


def test_a_deep_copy_of_the_prepared_model_is_plain_and_runs_its_own_parameters():
    """An EMA-style ``copy.deepcopy`` of a planned model: the copy has no RematHook, its forward computes with its own
    parameters (it ran the original's, and copying the planned session crashed the process at exit), and the
    original keeps training under its plan (NOTE [copies of a module we run])."""
    model = remat_accelerate.prepare(Accelerator(cpu=True), tiny_gpt2(), budget=10**12, ilp_time_limit_s=ILP_S)
    _step(model, token_ids(0), seed=0)
    copied = copy.deepcopy(model)
    assert find_hook(copied) is None and find_hook(model) is not None
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(0.5)
        copied.eval()
        ids = token_ids(1)
        assert torch.equal(copied(input_ids=ids).logits, type(copied).forward(copied, input_ids=ids).logits)
        assert not torch.equal(copied(input_ids=ids).logits, type(model).forward(model, input_ids=ids).logits)
    _step(model, token_ids(1), seed=1)
    assert find_hook(model).session.n_solved == 1


def test_save_state_load_state_round_trip_with_the_hook(tmp_path):
    """save_state/load_state restore weights and optimizer exactly and carry the plans: a resumed run goes on
    with the same losses, replaying the checkpoint's plan instead of solving."""
    model = tiny_gpt2()
    budget = _forced_budget(model, share=0.8)  # AdamW's state to come is taken out of it
    accelerator = Accelerator(cpu=True)
    model = remat_accelerate.prepare(accelerator, model, budget=budget, ilp_time_limit_s=ILP_S)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def train(model, optimizer, step: int) -> float:
        loss = _step(model, token_ids(step), seed=step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    train(model, optimizer, 0)
    accelerator.save_state(str(tmp_path))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    after_save = [train(model, optimizer, 1), train(model, optimizer, 2)]
    assert (tmp_path / plans_file(0)).exists()
    assert any(b.mode != "keep" for b in find_hook(model).session.plan.blocks)  # type: ignore[union-attr]

    fresh = Accelerator(cpu=True)  # a resumed run: new model, optimizer and hook
    resumed = remat_accelerate.prepare(fresh, tiny_gpt2(seed=1), budget=budget, ilp_time_limit_s=ILP_S)
    resumed_opt = fresh.prepare(torch.optim.AdamW(resumed.parameters(), lr=1e-3))
    fresh.load_state(str(tmp_path))
    assert all(torch.equal(saved[k], v) for k, v in resumed.state_dict().items())
    assert [train(resumed, resumed_opt, 1), train(resumed, resumed_opt, 2)] == after_save
    session = find_hook(resumed).session  # type: ignore[union-attr]
    assert session.n_solved == 0 and session.n_replayed == 1  # the checkpoint's plan, replayed


def test_hf_gradient_checkpointing_is_turned_off_and_checkpoint_wrappers_keep_remat_off(caplog):
    """HF's per-layer checkpointing is switched off with a warning; CheckpointWrapper modules leave us off."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_gpt2()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        prepared = remat_accelerate.prepare(Accelerator(cpu=True), model, budget="1GB")
    assert "turning off gradient checkpointing" in caplog.text
    assert not find_double_checkpointing(model)[0] and find_hook(prepared) is not None

    wrapped = tiny_gpt2()
    wrapped.transformer.h[0] = checkpoint_wrapper(wrapped.transformer.h[0])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        prepared = remat_accelerate.prepare(Accelerator(cpu=True), wrapped, budget="1GB")
    assert "CheckpointWrapper" in caplog.text and find_hook(prepared) is None



def test_bf16_mixed_precision_leaves_autocast_as_it_found_it(caplog):
    """Accelerate's mixed-precision forward is one ``torch.autocast`` object entered on every call; capture calling
    the module again through it (nested) left autocast on for the rest of the process, so the backward and the
    optimizer ran under it (NOTE in ``runtime/dispatch.py``).  Now autocast is off after every call, no backward
    is seen inside the block, and gradients are bitwise those of plain Accelerate under bf16 (float32 weights)."""
    plain, ours = tiny_gpt2().float(), tiny_gpt2().float()
    budget = _forced_budget(plain)
    plain_model = Accelerator(cpu=True, mixed_precision="bf16").prepare(plain)
    model = remat_accelerate.prepare(Accelerator(cpu=True, mixed_precision="bf16"), ours, budget=budget,
                                     ilp_time_limit_s=ILP_S, verbose=False)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        for step in range(3):
            for m, params in ((plain_model, plain), (model, ours)):
                params.zero_grad(set_to_none=True)
                torch.manual_seed(step)
                loss = m(input_ids=token_ids(step), labels=token_ids(step)).loss
                assert not torch.is_autocast_enabled("cpu")
                loss.backward()
            for (name, p), q in zip(plain.named_parameters(), ours.parameters()):
                assert torch.equal(p.grad, q.grad), (step, name)
    assert "torch.autocast block" not in caplog.text
    plan = find_hook(model).session.plan
    assert plan is not None and any(b.mode != "keep" for b in plan.blocks)
