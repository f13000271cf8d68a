"""Budget sweeps and oracle checks shared by the tests that check plans against a meter and plain PyTorch."""
from __future__ import annotations

from remat_plugin.ir.plan import Plan, budget_for_peak


def sweep(plan: Plan, n: int = 6) -> list[int]:
    """``n`` budgets from the unmodified peak (with its margin) down to the plan's smallest feasible budget."""
    base, floor = budget_for_peak(plan.baseline_peak_bytes), plan.min_feasible_bytes
    return [int(base - (base - floor) * i / (n - 1)) for i in range(n)]


def settle(step, n: int = 3) -> None:
    """``n`` training steps of a new plan before it is measured, as a training loop's first ones: the first is
    metered before it runs (calibration), the next re-plans for the outputs the loss drops (output usage)."""
    for _ in range(n):
        step()


def train_step(module, bench, batch, seed: int):
    """One training step of ``module`` (``bench.module`` or a plan of it) on ``batch``: gradients set afresh,
    RNG seeded, loss backward; returns the loss."""
    import torch

    args, kwargs = batch
    for p in bench.module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = bench.loss(module(*args, **kwargs))
    loss.backward()
    return loss.detach()


def step_grads(model, batches, loss=lambda output: output.loss, first_seed: int = 100) -> list:
    """One training step per batch (a dict of keyword arguments or a tuple of positional ones), RNG seeded per
    step, gradients set afresh; each step's parameter gradients (None where a parameter got none)."""
    import torch

    grads = []
    for i, batch in enumerate(batches):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(first_seed + i)
        output = model(**batch) if isinstance(batch, dict) else model(*batch)
        loss(output).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    return grads


def assert_bitwise_at_a_recomputing_budget(model, batches, loss=lambda output: output.loss, first_seed: int = 100):
    """Plan ``model`` halfway between its smallest feasible budget and its unmodified peak (a plan that
    recomputes), train ``batches`` on the plan and on a copy of the model as it was: every step's gradients
    equal bitwise.  Returns the planned module."""
    import copy

    import torch

    from remat_plugin import rematerialize

    reference = copy.deepcopy(model)
    args, kwargs = ((), batches[0]) if isinstance(batches[0], dict) else (batches[0], {})
    plan = rematerialize(copy.deepcopy(model), args, kwargs, budget=10**12, verbose=False).plan
    budget = (budget_for_peak(plan.baseline_peak_bytes) + plan.min_feasible_bytes) // 2  # both budgets, margins in
    rm = rematerialize(model, args, kwargs, budget=budget, verbose=False)
    assert not rm.plan.fallback and any(b.mode != "keep" for b in rm.plan.blocks), rm.plan.fallback
    for ours, eager in zip(step_grads(rm, batches, loss, first_seed), step_grads(reference, batches, loss, first_seed)):
        assert all(a is b is None or (a is not None and b is not None and torch.equal(a, b)) for a, b in zip(ours, eager))
    return rm


def assert_same_grads_and_buffers(module, reference, label: str) -> None:
    """Every parameter gradient and buffer of ``module`` equals ``reference``'s bitwise."""
    import torch

    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), f"{label}: gradient of {name} differs"
    for (name, b), c in zip(module.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), f"{label}: buffer {name} differs"


def planned_beside_eager(model, args: tuple, caplog=None, budget: int = 10**9):
    """``(planned, reference)``: ``model`` planned under ``budget`` on ``args`` (remat_plugin's warnings captured in
    ``caplog``, where given), and the eager deep copy made before it was planned, for the tests that compare the
    two."""
    import contextlib
    import copy
    import logging

    from remat_plugin import rematerialize

    reference = copy.deepcopy(model)
    with caplog.at_level(logging.WARNING, logger="remat_plugin") if caplog is not None else contextlib.nullcontext():
        planned = rematerialize(model, args, budget=budget, verbose=False)
    return planned, reference
