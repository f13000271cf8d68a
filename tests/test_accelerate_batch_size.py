"""The Accelerate integration's auto batch size: choose_batch_size and rebuild_dataloader, in process."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")
from accelerate import Accelerator
from accelerate_helpers import AUTO_BUDGET, ILP_S, clean_env, tiny_gpt2, token_ids
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset

from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.integrations import accelerate as remat_accelerate
from remat_plugin.integrations.accelerate import choose_batch_size, find_hook, rebuild_dataloader
from remat_plugin.runtime.budget import parse_budget


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    yield from clean_env(monkeypatch)


def _loader(rows: int = 16, batch_size: int = 2, **kwargs) -> DataLoader:
    tokens = torch.randint(0, 500, (rows, 64), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens), batch_size=batch_size, **kwargs)



def test_choose_batch_size_picks_the_largest_fitting_multiple_and_a_real_step_at_it_fits():
    """auto_batch_size on: a size above the script's, a multiple of multiple_of, whose next notch has no fitting plan;
    the rebuilt loader's first step at that size stays in the budget and reuses the plan made while verifying."""
    accelerator = Accelerator(cpu=True)
    model = remat_accelerate.prepare(accelerator, tiny_gpt2(), budget=AUTO_BUDGET, ilp_time_limit_s=ILP_S,
                                     auto_batch_size=True, multiple_of=2)
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = _loader(shuffle=True)
    (first,) = next(iter(loader))
    model.eval()  # as from_pretrained leaves it: the probe trains it for the while, then puts it back
    rng, weights = torch.get_rng_state(), {k: v.clone() for k, v in model.state_dict().items()}

    size = choose_batch_size(accelerator, model, ((), {"input_ids": first, "labels": first}), default=2)

    hook = find_hook(model)
    assert hook is not None and hook.session is not None
    choice = hook.batch_size_choice
    assert choice is not None and choice.batch_size == size and choice.objective == "max"
    assert size > 2 and size % 2 == 0, choice.summary()
    assert choice.budget_bytes < AUTO_BUDGET == parse_budget(hook.config.budget)  # less AdamW's state to come
    assert choice.next_size is not None and choice.next_size.batch_size == size + 2
    assert choice.next_size.predicted_time_ms is None and choice.next_size.min_feasible_bytes > choice.budget_bytes
    assert choice.trial_steps >= 1 and choice.measured_peak_bytes is not None
    assert choice.measured_peak_bytes <= choice.budget_bytes
    assert not model.training and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    solved = hook.session.n_solved
    assert choose_batch_size(accelerator, model, ((), {"input_ids": first, "labels": first}), default=2) == size

    model.train()
    loader = rebuild_dataloader(accelerator, loader, size)
    (ids,) = next(iter(loader))
    assert ids.shape == (size, 64)
    with PeakMeter("cpu") as meter:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert meter.peak_bytes <= AUTO_BUDGET, (meter.peak_bytes, choice.summary())
    assert hook.session.n_solved == solved  # the verification step's plan, reused
    assert hook.session.plan is not None and hook.session.plan.predicted_peak_bytes <= choice.budget_bytes


@pytest.mark.parametrize("how", ["argument off", "env off", "no budget"])
def test_choose_batch_size_off_returns_the_default_and_plans_nothing(monkeypatch, how):
    """Without auto batch size (or without a budget, so without a hook) the default comes back untouched."""
    if how == "env off":
        monkeypatch.setenv("REMAT_AUTO_BATCH_SIZE", "0")
    options = {"auto_batch_size": False} if how == "argument off" else {}
    budget = None if how == "no budget" else AUTO_BUDGET
    if how == "no budget":
        monkeypatch.setenv("REMAT_AUTO_BATCH_SIZE", "1")
    accelerator = Accelerator(cpu=True)
    model = remat_accelerate.prepare(accelerator, tiny_gpt2(), budget=budget, **options)
    ids = token_ids(0)
    assert choose_batch_size(accelerator, model, ((), {"input_ids": ids, "labels": ids}), default=4) == 4
    hook = find_hook(model)
    if how == "no budget":
        assert hook is None
    else:
        assert hook is not None and hook.session is not None and hook.batch_size_choice is None
        assert hook.session.plans == {} and hook.session.n_solved == 0


def test_rebuild_dataloader_keeps_the_dataset_sampler_and_options_from_a_plain_or_prepared_loader():
    """The new loader has the new batch size and the old one's shuffling, collate_fn, drop_last and workers; a
    prepared loader's base loader is rebuilt and the old one leaves the accelerator's list."""
    accelerator = Accelerator(cpu=True)

    def collate(rows):
        return torch.stack([r[0] for r in rows])

    plain = _loader(rows=20, batch_size=2, shuffle=True, collate_fn=collate, drop_last=True)
    for given in (plain, accelerator.prepare(plain)):
        before = list(accelerator._dataloaders)
        new = rebuild_dataloader(accelerator, given, 8)
        assert accelerator._dataloaders == [d for d in before if d is not given] + [new]
        base = new.base_dataloader
        assert base.dataset is plain.dataset and base.collate_fn is collate
        assert (base.num_workers, base.pin_memory, base.batch_sampler.drop_last) == (0, False, True)
        assert isinstance(base.batch_sampler.sampler, RandomSampler)
        batches = list(new)
        assert [b.shape for b in batches] == [(8, 64)] * 2  # 20 rows, drop_last
    ordered = rebuild_dataloader(accelerator, _loader(), 4)
    assert isinstance(ordered.base_dataloader.batch_sampler.sampler, SequentialSampler)
    assert torch.equal(next(iter(ordered))[0], _loader().dataset.tensors[0][:4])

