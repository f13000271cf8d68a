"""A first plan that steps down (NOTE [loss-only first plan]) under DDP with 2 CPU processes (gloo): rank 0 plans it,
both ranks run it with gradients equal to plain DDP's, and a use of the outputs it cannot run on one rank stops
both ranks in that backward, before any gradient is all-reduced: no rank is left waiting."""
import copy
import gc
import os

import pytest
import torch
import torch.distributed as dist
from model_factories import TinyLM
from torch.nn.parallel import DistributedDataParallel as DDP
from two_ranks import session_on, spawn_two

pytestmark = pytest.mark.slow

MiB = 2**20
# TinyLM at 32 x 64 tokens (test_output_usage.py): floors 80.40 MiB with the logits differentiated, 64.32 MiB held
# without a gradient, 48.24 MiB freed after the forward.
HELD_BUDGET, FREED_BUDGET = 72 * MiB, 56 * MiB


def _worker(rank: int, port: int, out_dir: str, budget: int, misusing_rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = TinyLM()
    ours = copy.deepcopy(plain)
    session = session_on(ours, budget)
    reference, model = DDP(plain), DDP(ours)
    ids = torch.randint(0, 2048, (32, 64), generator=torch.Generator().manual_seed(rank))  # each rank its own data
    same = True
    for _ in range(2):  # a loop keeping only the loss
        for m in (reference, model):
            m.zero_grad(set_to_none=True)
            m(ids, ids)[0].backward()
        same &= all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), ours.parameters()))
    plan = session.plan
    result = {"same": same, "first": next(ours.parameters()).grad.clone(), "solved": session.n_solved,
              "uses": (plan.ungraded_outputs, plan.dropped_outputs, plan.loss_only_floors),
              "peak": plan.predicted_peak_bytes}
    out = model(ids, ids)
    if rank == misusing_rank:  # a gradient into the logits, or the logits held through backward()
        loss = out[0] + out[1].mean() if budget == HELD_BUDGET else out[0]
    else:
        loss = out[0]
    if budget == FREED_BUDGET and rank != misusing_rank:
        out = None  # the logits dropped before backward(), as that plan needs
    try:
        loss.backward()
        result["error"] = None
    except Exception as exc:  # noqa: BLE001 -- what each rank raised is the result
        result["error"] = (type(exc).__name__, str(exc))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    del model, reference, out, loss  # DDP's reducers go while the process group is alive
    gc.collect()
    dist.destroy_process_group()


def _held_case(rank, port, out_dir):
    _worker(rank, port, out_dir, HELD_BUDGET, misusing_rank=1)


def _freed_case(rank, port, out_dir):
    _worker(rank, port, out_dir, FREED_BUDGET, misusing_rank=0)


@pytest.mark.parametrize("case", [_held_case, _freed_case], ids=["logits-held", "logits-freed"])
def test_step_down_is_agreed_and_a_refusal_stops_every_rank(tmp_path, case):
    spawn_two(case, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    budget = HELD_BUDGET if case is _held_case else FREED_BUDGET
    misusing = 1 if case is _held_case else 0
    assert r0["same"] and r1["same"], "gradients differ from plain DDP's"
    assert torch.equal(r0["first"], r1["first"]), "all-reduced gradients differ between ranks"
    assert (r0["solved"], r1["solved"]) == (1, 0), "rank 0 plans, rank 1 runs its plan"
    assert r0["uses"] == r1["uses"]
    ungraded, dropped, floors = r0["uses"]
    if budget == HELD_BUDGET:  # held without a gradient, then freed for this loop, which drops them on every rank
        assert (ungraded, dropped, len(floors)) == ((), (1,), 1) and floors[0] > budget  # NOTE [refined step-down]
    else:
        assert (ungraded, dropped, len(floors)) == ((), (1,), 2) and floors[1] > budget
    assert r0["peak"] <= budget
    errors = {0: r0["error"], 1: r1["error"]}
    kind, text = errors[misusing]
    assert kind == "InfeasibleBudgetError" and "refused before it ran" in text
    assert ("sends a gradient into output(s) [1]" if budget == HELD_BUDGET else "keeps output(s) [1]") in text
    other_kind, other_text = errors[1 - misusing]
    assert other_kind == "RematError" and f"rank {misusing} failed" in other_text and "InfeasibleBudgetError" in other_text


def _apart_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    module = TinyLM()
    session = session_on(module, HELD_BUDGET)
    model = DDP(module)
    ids = torch.randint(0, 2048, (32, 64), generator=torch.Generator().manual_seed(rank))
    model(ids, ids)[0].backward()  # the same shapes on both ranks: the plan steps down, agreed
    shorter = ids[:, :48] if rank == 1 else ids  # then rank 1 meets a shorter batch
    try:
        model(shorter, shorter)[0].backward()
        error = None
    except Exception as exc:  # noqa: BLE001 -- what each rank raised is the result
        error = (type(exc).__name__, str(exc))
    torch.save({"error": error, "floors": session.plan.loss_only_floors}, os.path.join(out_dir, f"rank{rank}.pt"))
    del model
    gc.collect()
    dist.destroy_process_group()


def test_ranks_that_see_different_shapes_beside_a_stepped_down_plan_stop_together(tmp_path):
    """A stepped-down plan's backward checks the outputs' use with every rank, so every rank must run it: when one
    rank meets other shapes, every rank raises the same clear error at that call, none waits in a collective."""
    spawn_two(_apart_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["floors"] and r0["floors"] == r1["floors"]
    for r in (r0, r1):
        kind, text = r["error"]
        assert kind == "RematError" and "ranks see different input shapes" in text and "pad to fixed lengths" in text
        assert "raise the budget to at least" in text
