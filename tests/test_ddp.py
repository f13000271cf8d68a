"""The rewritten module under DistributedDataParallel (2 CPU processes, gloo): DDP's gradient hooks fire."""
import gc
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from two_ranks import spawn_two

pytestmark = pytest.mark.slow


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
    del model, module  # DDP's reducer goes while the process group is alive (gloo can hang destroying it after)
    gc.collect()
    dist.destroy_process_group()


def test_ddp_gradients_equal_plain_ddp(tmp_path):
    """Under DDP with different data per rank, planned gradients equal plain DDP's and agree across ranks."""
    spawn_two(_worker, tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert r0["same"] and r1["same"]
    assert torch.equal(r0["first"], r1["first"]), "all-reduced gradients differ between ranks"


def _overlap_worker(rank: int, port: int, out_dir: str) -> None:
    """Per mode: DDP's gradients (vs plain DDP) and how far the backward was when DDP's first bucket was handed over."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    from remat_plugin.bench.models import build
    from remat_plugin.runtime.module import RematModule

    class OpCount(TorchDispatchMode):  # matrix products: the backward's compute, none of DDP's bookkeeping
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    result = {}
    for mode in ("plain", "one node", "segmented"):
        bench = build("gpt2-tiny", n_layer=3, batch_size=4, seq_len=128, dtype=torch.float64)
        args, kwargs = bench.make_batch(rank)
        module = bench.module
        if mode != "plain":
            module = RematModule(bench.module, budget=10**12, verbose=False)
            module(*args, **kwargs)
            plan = module._resolver.current_plan
            module = RematModule(bench.module, budget=(plan.baseline_peak_bytes + plan.min_feasible_bytes) // 2,
                                 verbose=False, backward_segments=1 if mode == "one node" else 8)
        model = DDP(module, bucket_cap_mb=0.5)
        counter = OpCount()
        handed: list[int] = []

        def hook(state, bucket, counter=counter, handed=handed):
            handed.append(counter.n)
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)
        for _ in range(3):  # the first call traces and plans; the last is measured
            bench.module.zero_grad(set_to_none=True)
            handed.clear()
            torch.manual_seed(7)
            loss = bench.loss(model(*args, **kwargs))
            counter.n = 0
            with counter:
                loss.backward()
        result[mode] = {"grads": [p.grad.clone() for p in bench.module.parameters()],
                        "first_bucket": handed[0] / counter.n, "buckets": len(handed),
                        "segments": module._resolver.latest.run.backward.n_segments if mode != "plain" else 0}
    torch.save(result, os.path.join(out_dir, f"overlap{rank}.pt"))
    del model, module  # DDP's reducer goes while the process group is alive (gloo can hang destroying it after)
    gc.collect()
    dist.destroy_process_group()


def test_ddp_buckets_all_reduce_while_the_backward_runs(tmp_path):
    """DDP's first bucket is handed to its all-reduce before half the planned backward's matrix products ran (NOTE
    [segmented backward]); with the backward as one node, after all of them.  Gradients equal plain DDP's."""
    spawn_two(_overlap_worker, tmp_path)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"overlap{rank}.pt")
        for mode in ("one node", "segmented"):
            assert all(torch.equal(a, b) for a, b in zip(r["plain"]["grads"], r[mode]["grads"])), mode
        assert r["segmented"]["buckets"] > 2 and r["segmented"]["segments"] >= 4, r["segmented"]
        assert r["segmented"]["first_bucket"] < 0.5, r["segmented"]
        assert r["one node"]["first_bucket"] == 1.0, r["one node"]  # after the backward's last matrix product
