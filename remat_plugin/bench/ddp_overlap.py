"""DDP step time with the planned backward released in segments against the same plan run as one node.

    python -m remat_plugin.bench ddp-overlap [--model gpt2-tiny] [--budget 0.5] [--bucket-cap-mb 25,4]
        [--batch-size B] [--seq-len S] [--pairs 9] [--json results/ddp_overlap_cpu.json]

Two processes (gloo on CPU, one thread each) train two copies of the model under
DistributedDataParallel: one rematerialized with the segmented backward (NOTE [segmented
backward]: DDP's buckets all-reduce while the backward still computes), one with
``backward_segments=1`` (every gradient at the end, as before).  Steps alternate between the
two, which one goes first alternating too; rank 0's medians are reported, with the time one
all-reduce of every gradient takes alone (the most that overlapping can hide).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

MODES = ("segmented", "one node")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step(model: DDP, bench, args: tuple, kwargs: dict) -> float:
    bench.module.zero_grad(set_to_none=True)
    dist.barrier()
    t0 = time.perf_counter()
    bench.loss(model(*args, **kwargs)).backward()  # DDP waits for its all-reduces at the end
    return time.perf_counter() - t0


def _worker(rank: int, port: int, opts: dict, out: str) -> None:
    from remat_plugin.bench.models import build
    from remat_plugin.capture.segments import MAX_SEGMENTS
    from remat_plugin.runtime.module import RematModule

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    results: dict = {}
    for cap in opts["caps"]:
        models, benches = {}, {}
        for mode in MODES:
            bench = build(opts["model"], **opts["shape"])
            args, kwargs = bench.make_batch(rank)
            probe = RematModule(bench.module, budget=10**12, verbose=False)
            probe(*args, **kwargs)
            plan = probe._resolver.current_plan
            assert plan is not None
            floor, peak = plan.min_feasible_bytes, plan.baseline_peak_bytes
            module = RematModule(bench.module, budget=int(floor + opts["budget"] * (peak - floor)), verbose=False,
                                 backward_segments=1 if mode == "one node" else MAX_SEGMENTS)
            models[mode], benches[mode] = DDP(module, bucket_cap_mb=cap), (bench, args, kwargs)

        for _ in range(3):  # plan, re-plan for the dropped logits, first replay
            for mode in MODES:
                _step(models[mode], *benches[mode])
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for k in range(opts["pairs"]):
            for mode in (MODES if k % 2 == 0 else MODES[::-1]):
                times[mode].append(_step(models[mode], *benches[mode]))
        grads = [p.grad for p in benches["segmented"][0].module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm = []
        for _ in range(opts["pairs"]):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            comm.append(time.perf_counter() - t0)
        results[str(cap)] = {"median_s": {m: statistics.median(v) for m, v in times.items()}, "times_s": times,
                             "allreduce_s": statistics.median(comm), "grad_mib": flat.numel() * flat.element_size() / 2**20,
                             "plan_overhead": models["segmented"].module._resolver.current_plan.predicted_overhead}
        # DDP's reducers go while the process group is alive: destroyed after it, gloo can hang in their destructor.
        del models, benches, grads, flat
        gc.collect()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--budget", type=float, default=0.5, help="where the budget lies from the smallest feasible one (0) to the unmodified step's peak (1)")
    parser.add_argument("--bucket-cap-mb", default="25,4", help="DDP bucket sizes to run, comma-separated")
    parser.add_argument("--batch-size", type=int, help="the model's own default when left out")
    parser.add_argument("--seq-len", type=int, help="the model's own default when left out")
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--json")
    opts = parser.parse_args(argv)
    caps = [float(c) for c in opts.bucket_cap_mb.split(",")]
    shape = {k: v for k, v in (("batch_size", opts.batch_size), ("seq_len", opts.seq_len)) if v is not None}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(_worker, args=(_free_port(), {"model": opts.model, "budget": opts.budget, "caps": caps,
                                               "pairs": opts.pairs, "shape": shape}, out), nprocs=2, join=True)
        with open(out) as f:
            results = json.load(f)
    for cap, r in results.items():
        seg, one = r["median_s"]["segmented"], r["median_s"]["one node"]
        print(f"{opts.model} {shape or ''}, 2 processes (gloo), bucket_cap_mb={cap}, budget {opts.budget} of the way from the floor to the peak "
              f"(predicted overhead {r['plan_overhead']:.2f}x): step {seg * 1e3:.0f} ms segmented, {one * 1e3:.0f} ms "
              f"one node ({seg / one - 1:+.1%}); one all-reduce of the {r['grad_mib']:.1f} MiB of gradients alone "
              f"{r['allreduce_s'] * 1e3:.0f} ms ({opts.pairs} interleaved pairs, medians)")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"model": opts.model, "shape": shape, "budget": opts.budget, "pairs": opts.pairs, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
