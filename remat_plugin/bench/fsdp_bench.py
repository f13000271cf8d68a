"""FSDP2 with planned rematerialization against plain FSDP2 and FSDP2 + per-layer checkpointing.

    python -m remat_plugin.bench fsdp [--model gpt2-tiny] [--layers 4] [--batch-size 4] [--seq-len 128]
        [--budgets 0.6,0.7,0.8,0.9,1.0] [--dtype float32] [--steps 6] [--pairs 7] [--json results/fsdp_cpu.json]

``torchrun --nproc_per_node 2`` (gloo on CPU, NCCL on CUDA) runs this module as its worker: every
layer and then the model are ``fully_shard``-ed.  Three set-ups train the same weights on the same
batches (each rank its own): plain FSDP2, FSDP2 with HF's per-layer checkpointing
(``gradient_checkpointing_enable(use_reentrant=False)``) and ours (:func:`rematerialize_fsdp`) at each
budget, a share of plain FSDP2's measured peak, and at per-layer checkpointing's measured peak.
Per set-up: losses and gradients (gathered from the shards) against plain FSDP2's on every step
(bitwise), each rank's allocator peak over one forward+backward (the profiler's memory events on
CPU, ``max_memory_allocated`` on CUDA) on every step after the second, the highest of the steps and
ranks reported (gloo's reduce-scatter clone is there in some steps and not others).  At
per-layer checkpointing's peak the two step times are interleaved over ``pairs`` pairs (medians).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist


def _peak_of(fn, device: torch.device) -> int:
    from remat_plugin.capture.memory_meter import allocator_trace, memory_profile

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    with memory_profile() as prof:
        fn()
    return allocator_trace(prof, device).peak_rise()[0]


class _Run:
    """One sharded copy of the model under one set-up, stepping on this rank's batch."""

    def __init__(self, opts: dict, setup: str, budget: int | None = None):
        from torch.distributed.fsdp import fully_shard

        from remat_plugin.bench.models import build
        from remat_plugin.bench.peers import per_layer_checkpoint
        from remat_plugin.runtime.fsdp_units import rematerialize_fsdp

        dtype = getattr(torch, opts["dtype"])
        self.bench = build(opts["model"], n_layer=opts["layers"], batch_size=opts["batch_size"],
                           seq_len=opts["seq_len"], dtype=dtype, device=opts["device"])
        self._setup = contextlib.ExitStack()  # open for the run's life
        if setup == "per-layer checkpointing":
            self._setup.enter_context(per_layer_checkpoint(self.bench))
        for layer in self.bench.layers:
            fully_shard(layer)
        fully_shard(self.bench.module)
        self.remat = rematerialize_fsdp(self.bench.module, budget) if budget is not None else None
        self.args, self.kwargs = self.bench.make_batch(dist.get_rank())
        self.device = torch.device(opts["device"])
        self.n = 0

    def step(self, meter: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor], int | None, float]:
        """Step ``n`` (its dropout seeded by ``n``): loss, full gradients, peak when metered, seconds."""
        for p in self.bench.module.parameters():
            p.grad = None
        torch.manual_seed(1000 + self.n)
        self.n += 1
        out: dict[str, Any] = {}

        def fwd_bwd():
            out["loss"] = self.bench.loss(self.bench.module(*self.args, **self.kwargs))
            out["loss"].backward()

        dist.barrier()
        t0 = time.perf_counter()
        peak = _peak_of(fwd_bwd, self.device) if meter else fwd_bwd()
        seconds = time.perf_counter() - t0
        grads = {n: _full(p.grad) for n, p in self.bench.module.named_parameters() if p.grad is not None}
        return out["loss"].detach(), grads, peak, seconds


def _full(grad: Any) -> torch.Tensor:
    """A sharded gradient (a DTensor) gathered whole on every rank."""
    return grad.full_tensor()


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _highest(value: int | None) -> int | None:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return None if any(v is None for v in values) else max(values)  # type: ignore[type-var]


def _trained(opts: dict, setup: str, reference: list | None, budget: int | None = None) -> tuple[dict, list, _Run]:
    """``opts['steps']`` steps of one set-up: bitwise against ``reference``, peaks of the steps after the second."""
    from remat_plugin.errors import InfeasibleBudgetError

    run = _Run(opts, setup, budget)
    steps, peaks = [], []
    try:
        for k in range(opts["steps"]):
            steps.append(run.step(meter=k >= 2))
            peaks.append(steps[-1][2])
    except InfeasibleBudgetError as exc:
        return {"infeasible": True, "min_feasible_bytes": exc.min_feasible_bytes}, [], run
    peak = _highest(max(p for p in peaks if p is not None))
    differ = [k for k, (a, b) in enumerate(zip(reference, steps)) if not _same(a, b)] if reference is not None else []
    row: dict[str, Any] = {"peak_bytes": peak, "bitwise": _highest(len(differ)) == 0, "steps_not_bitwise": differ,
                           "losses": [s[0].item() for s in steps]}
    if run.remat is not None:
        row["measured_step_bytes"] = run.remat.measured_peaks
        row["unit_plans"] = [{"predicted_peak_bytes": p.predicted_peak_bytes, "predicted_overhead": p.predicted_overhead,
                              "modes": [b.mode for b in p.blocks]} for p in run.remat.plans.values()]
        row["unit_lowest"] = [{"predicted_peak_bytes": g.lowest.predicted_peak_bytes,
                               "kept_bytes": run.remat.kept_bytes(g.key, g.lowest)} for g in run.remat.groups.values()]
    return row, steps, run


def worker(opts: dict) -> None:
    dist.init_process_group("nccl" if opts["device"] == "cuda" else "gloo")
    if opts["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        opts["device"] = f"cuda:{torch.cuda.current_device()}"
    else:
        torch.set_num_threads(1)
    result: dict[str, Any] = {"opts": opts, "world_size": dist.get_world_size()}
    plain, reference, _ = _trained(opts, "plain", None)
    result["plain"] = plain
    ckpt, _, ckpt_run = _trained(opts, "per-layer checkpointing", reference)
    result["per-layer checkpointing"] = ckpt
    result["ours"] = {}
    for share in opts["budgets"]:
        budget = int(share * plain["peak_bytes"])
        row, _, _ = _trained(opts, "ours", reference, budget)
        result["ours"][str(share)] = {"budget_bytes": budget, **row}
    if opts["pairs"]:
        row, _, ours_run = _trained(opts, "ours", reference, ckpt["peak_bytes"])
        result["ours at checkpointing's peak"] = {"budget_bytes": ckpt["peak_bytes"], **row}
        if not row.get("infeasible"):
            times: dict[str, list[float]] = {"ours": [], "per-layer checkpointing": []}
            for k in range(opts["pairs"]):
                order = [("ours", ours_run), ("per-layer checkpointing", ckpt_run)]
                for name, run in (order if k % 2 == 0 else order[::-1]):
                    times[name].append(run.step()[3])
            result["step_s"] = {name: statistics.median(v) for name, v in times.items()}
            result["step_ratio"] = result["step_s"]["ours"] / result["step_s"]["per-layer checkpointing"]
    if dist.get_rank() == 0:
        with open(opts["out"], "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def launch(opts: dict, nproc: int = 2, timeout_s: float = 1200) -> dict:
    """Run :func:`worker` under ``torchrun --nproc_per_node nproc``; rank 0's results."""
    with tempfile.TemporaryDirectory() as tmp:
        opts = {**opts, "out": os.path.join(tmp, "fsdp.json")}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "remat_plugin.bench.fsdp_bench", "--worker", json.dumps(opts)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"remat_plugin.bench.fsdp: torchrun exited with {proc.returncode}:\n{proc.stderr[-6000:]}")
        with open(opts["out"]) as f:
            return json.load(f)


def report(result: dict) -> str:
    mib = 2**20
    opts = result["opts"]
    lines = [(f"FSDP2, {result['world_size']} ranks, {opts['model']} {opts['layers']} layers, {opts['dtype']}: "
              "highest rank's peak per forward+backward")]
    plain, ckpt = result["plain"], result["per-layer checkpointing"]
    lines.append(f"  plain FSDP2                 {plain['peak_bytes'] / mib:8.2f} MiB")
    lines.append(f"  + per-layer checkpointing   {ckpt['peak_bytes'] / mib:8.2f} MiB  bitwise {ckpt['bitwise']}")
    for share, row in result["ours"].items():
        if row.get("infeasible"):
            lines.append(f"  ours, budget {share:>4} x plain  infeasible: smallest {row['min_feasible_bytes'] / mib:.2f} MiB")
        else:
            lines.append(f"  ours, budget {share:>4} x plain {row['peak_bytes'] / mib:8.2f} MiB  (budget "
                         f"{row['budget_bytes'] / mib:.2f})  bitwise {row['bitwise']}")
    at = result.get("ours at checkpointing's peak")
    if at is not None and at.get("infeasible"):
        lines.append(f"  at checkpointing's peak ({ckpt['peak_bytes'] / mib:.2f} MiB): ours infeasible, smallest "
                     f"{at['min_feasible_bytes'] / mib:.2f} MiB")
    if "step_ratio" in result:
        at_ckpt = result["ours at checkpointing's peak"]
        lines.append(f"  at checkpointing's peak: ours {at_ckpt['peak_bytes'] / mib:.2f} "
                     f"MiB, step {result['step_s']['ours']:.3f} s vs {result['step_s']['per-layer checkpointing']:.3f} s "
                     f"({result['step_ratio']:.3f}x)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--budgets", default="0.6,0.7,0.8,0.9,1.0", help="shares of plain FSDP2's measured peak")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return
    opts = {"model": args.model, "layers": args.layers, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "budgets": [float(b) for b in args.budgets.split(",")], "dtype": args.dtype, "device": args.device,
            "steps": args.steps, "pairs": args.pairs}
    result = launch(opts, args.nproc)
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
