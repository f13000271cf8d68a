"""Rank agreement with 2 CPU processes (gloo): a fallback plan is run alike on every rank; a failure on rank 0
while it plans reaches the other rank instead of leaving it waiting."""
import copy
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from two_ranks import session_on, spawn_two

pytestmark = pytest.mark.slow


class _BranchyLayers(nn.Module):
    """Data-dependent control flow at the top (torch.export cannot capture it), repeated layers inside."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Dropout(0.2), nn.Linear(512, 64))
                                    for _ in range(4))

    def forward(self, x):
        if x.mean() > 10:
            x = x * 2
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _fallback_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = _BranchyLayers().double()
    ours = copy.deepcopy(plain)
    session = session_on(ours, budget=int(6.5 * 2**20))  # below the unmodified step's peak (9.6 MiB)
    x = torch.randn(128, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    same = True
    for _ in range(2):
        for module in (plain, ours):
            module.zero_grad(set_to_none=True)
            torch.manual_seed(3)
            module(x).backward()
        same &= all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ours.parameters()))
    torch.save({"same": same, "fallback": session.plan.fallback, "solved": session.n_solved,
                "checkpointed": [b.mode == "checkpoint" for b in session.plan.blocks],
                "peaks": (session.plan.predicted_peak_bytes, session.plan.baseline_peak_bytes)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_fallback_plan_is_agreed_and_run_on_every_rank(tmp_path):
    """An uncapturable model under 2 ranks: rank 0 makes the fallback plan, both run it, gradients equal eager;
    every rank meters it and the highest peak decides, so both checkpoint the same layers (NOTE [metered
    fallback]), some but not all under a budget between the unmodified step's peak and per-layer checkpointing's."""
    spawn_two(_fallback_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["same"] and r1["same"]
    assert r0["fallback"] and r0["fallback"] == r1["fallback"] and "'layers'" in r0["fallback"]
    assert (r0["solved"], r1["solved"]) == (1, 0)
    assert r0["checkpointed"] == r1["checkpointed"] and 0 < sum(r0["checkpointed"]) < 4, r0
    assert r0["peaks"] == r1["peaks"] and r0["peaks"][0] <= int(6.5 * 2**20) < r0["peaks"][1], r0


def _failing_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from remat_plugin.runtime.resolver import StepResolver

    if rank == 0:
        def fail(self, call, budget_bytes):
            raise RuntimeError("injected failure while planning")

        StepResolver.solve_bucket = fail  # type: ignore[method-assign]
    module = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1))
    session_on(module)
    t0 = time.perf_counter()
    try:
        module(torch.randn(4, 16)).sum().backward()
        message = "no error"
    except Exception as exc:  # noqa: BLE001 -- the test records whatever was raised
        message = f"{type(exc).__name__}: {exc}"
    torch.save({"message": message, "s": time.perf_counter() - t0}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_any_failure_on_rank_zero_reaches_every_rank(tmp_path):
    """A RuntimeError on rank 0 during planning is raised on both ranks, with its message, within 30 s."""
    spawn_two(_failing_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["message"] == "RuntimeError: injected failure while planning"
    assert r1["message"].startswith("RematError") and "injected failure while planning" in r1["message"]
    assert r0["s"] < 30 and r1["s"] < 30


def _outputs_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from remat_plugin.bench.models import build

    bench = build("gpt2-tiny", n_layer=2, batch_size=4, seq_len=64, dtype=torch.float64)
    plain = bench.module
    ours = copy.deepcopy(plain)
    session = session_on(ours, budget=10**9)
    models = {"plain": DDP(plain), "ours": DDP(ours)}
    args, kwargs = bench.make_batch(rank)  # each rank its own data
    record = []
    for step in range(4):
        hold = step >= 2  # steps 0-1 keep .loss only; steps 2-3 hold the output through backward
        for name, model in models.items():
            model.module.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = model(*args, **kwargs)
            loss = out.loss
            if not hold:
                del out
            loss.backward()
            del loss
            out = None
        same = all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ours.parameters()))
        plan = session.plan
        record.append((same, plan.dropped_outputs, plan.ungraded_outputs))
    torch.save({"record": record, "solved": session.n_solved}, os.path.join(out_dir, f"rank{rank}.pt"))
    del models
    dist.destroy_process_group()


def test_ranks_re_plan_together_for_the_outputs_their_callers_drop(tmp_path):
    """Under DDP, a loss-only loop on both ranks: rank 0 plans again with the logits dropped and both run it;
    once both hold the output through backward (no gradient reaching the logits), they re-plan for that.
    Gradients stay those of plain DDP, bitwise."""
    spawn_two(_outputs_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["record"] == r1["record"]
    assert all(same for same, _, _ in r0["record"])
    logits = 1
    # step 0 planned as the callers keep everything; step 1 ran the plan without the logits; step 2 ran it while
    # the callers held them (warned), step 3 the plan that keeps them, without their gradient.
    assert [(d, u) for _, d, u in r0["record"]] == [((), ()), ((logits,), ()), ((logits,), ()), ((), (logits,))]
    assert (r0["solved"], r1["solved"]) == (1, 0)


def _calibration_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from remat_plugin.runtime import agreement

    real_meter = agreement.metered_step
    metered = []

    def metering(module, step, call):  # rank 1's allocator sees 1 MiB more than the plan predicts, once
        peak = real_meter(module, step, call)
        metered.append(peak)
        return peak + (2**20 if rank == 1 and len(metered) == 1 else 0)

    agreement.metered_step = metering
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(128, 128), nn.GELU(), nn.Dropout(0.1)]
    plain = nn.Sequential(*layers, nn.Linear(128, 1)).double()
    ours = copy.deepcopy(plain)
    x = torch.randn(256, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    session = session_on(ours, budget=10**9)
    models = {"plain": DDP(plain), "ours": DDP(ours)}
    same = True
    for step in range(3):
        for model in models.values():
            model.module.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            model(x).square().mean().backward()
        same &= all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ours.parameters()))
    key = next(iter(session.resolver.steps))
    torch.save({"same": same, "metered": len(metered), "corrections": session.resolver.calibration.corrections[key],
                "agreed": session.agreement._agreed[key].to_json()}, os.path.join(out_dir, f"rank{rank}.pt"))
    del models
    dist.destroy_process_group()


def test_ranks_meter_a_new_plan_and_correct_it_together(tmp_path):
    """NOTE [calibration] under DDP: every rank meters the agreed plan before its first step; one rank's peak above
    the prediction makes rank 0 plan again with the gap kept back, and both run that plan (metered in turn)."""
    spawn_two(_calibration_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["same"] and r1["same"]
    assert r0["metered"] == r1["metered"] == 2  # the first plan, then the corrected one; nothing once settled
    assert r0["corrections"] == r1["corrections"] and len(r0["corrections"]) == 1 and r0["corrections"][0] > 0.9 * 2**20
    assert r0["agreed"] == r1["agreed"]
