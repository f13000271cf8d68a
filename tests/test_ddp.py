"""The rewritten module under DistributedDataParallel (2 CPU processes, gloo): DDP's gradient hooks fire."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from remat_plugin import rematerialize
    from remat_plugin.bench.models import mlp_chain

    grads = {}
    for use_remat in (False, True):
        bench = mlp_chain(dtype=torch.float64, seed=0)
        args, kwargs = bench.make_batch(rank)  # each rank its own data: gradients must be all-reduced
        module = bench.module
        if use_remat:
            plan = rematerialize(module, args, kwargs, budget=10**12).plan
            module = rematerialize(module, args, kwargs, budget=(plan.baseline_peak_bytes + plan.min_feasible_bytes) // 2)
        model = DDP(module)
        torch.manual_seed(7)
        model(*args, **kwargs).backward()
        grads[use_remat] = [p.grad.clone() for p in bench.module.parameters()]
    same = all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
    torch.save({"same": same, "first": grads[True][0]}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_gradients_equal_plain_ddp(tmp_path):
    """Under DDP with different data per rank, planned gradients equal plain DDP's and agree across ranks."""
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["same"] and r1["same"]
    assert torch.equal(r0["first"], r1["first"]), "all-reduced gradients differ between ranks"
