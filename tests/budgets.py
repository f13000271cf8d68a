"""Budget sweeps and oracle checks shared by the tests that check plans against a meter and plain PyTorch."""
from __future__ import annotations

from remat_plugin.ir.plan import Plan, budget_for_peak


def sweep(plan: Plan, n: int = 10) -> list[int]:
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


def assert_same_grads_and_buffers(module, reference, label: str) -> None:
    """Every parameter gradient and buffer of ``module`` equals ``reference``'s bitwise."""
    import torch

    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), f"{label}: gradient of {name} differs"
    for (name, b), c in zip(module.named_buffers(), reference.buffers()):
        assert torch.equal(b, c), f"{label}: buffer {name} differs"
