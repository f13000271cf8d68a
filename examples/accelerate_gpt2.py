"""Train a tiny GPT-2 with Accelerate; remat_plugin fits each step into ``REMAT_BUDGET`` when it is set.

    REMAT_BUDGET=3MB accelerate launch examples/accelerate_gpt2.py --cpu
    remat launch --budget 3MB --multi_gpu --num_processes 2 --num_machines 1 examples/accelerate_gpt2.py --cpu
    remat launch --budget 3MB --config_file configs/accelerate_cpu.yaml examples/accelerate_gpt2.py --cpu
    REMAT_BUDGET=8MB REMAT_AUTO_BATCH_SIZE=1 accelerate launch examples/accelerate_gpt2.py --cpu

The script calls ``remat_plugin.integrations.accelerate.prepare(accelerator, model)`` with no
budget: the launch flag turns remat on, and without it the run is plain Accelerate.  Rank 0
prints the plan and, per step, the loss and the measured peak (forward, backward and optimizer
step; planning included).  ``--compare`` first measures one unmodified step on a copy of the
model, to print the memory saved.  ``--json OUT`` writes each rank's results to ``OUT.rank<N>.json``.

With auto batch size (``--auto-batch-size`` or ``REMAT_AUTO_BATCH_SIZE=1``, and a budget) the
script asks ``choose_batch_size`` for the per-process batch size, from the arguments of its
first batch, and rebuilds its dataloader with it (``rebuild_dataloader``): the same data in
fewer, larger steps.  Without it the batch size is ``--batch-size``.

On a machine without GPUs pass ``--cpu``: Accelerate's workers then form a MULTI_CPU (gloo)
group; without it each of them runs alone.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.errors import human_bytes
from remat_plugin.integrations import accelerate as remat_accelerate
from remat_plugin.runtime.budget import parse_budget


def build_model(opts: argparse.Namespace):
    """GPT-2 from a config (never downloaded), in ``opts.dtype``, with dropout on."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=opts.n_layer, n_embd=opts.n_embd, n_head=opts.n_head, vocab_size=opts.vocab_size,
                        n_positions=opts.seq_len, use_cache=False,  # a training step has no use for the KV cache
                        bos_token_id=opts.vocab_size - 1, eos_token_id=opts.vocab_size - 1)
    model = GPT2LMHeadModel(config).to(getattr(torch, opts.dtype)).train()
    model.loss_type = "ForCausalLM"  # HF's default, named so it does not warn that none was set
    return model


def train_step(model, optimizer, accelerator: Accelerator, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def unmodified_peak(model, opts: argparse.Namespace, accelerator: Accelerator, ids: torch.Tensor) -> int:
    """Peak of one step of a copy of the model without remat; the random streams are left where they were."""
    copy_ = copy.deepcopy(model).to(accelerator.device)
    optimizer = torch.optim.AdamW(copy_.parameters(), lr=opts.lr)
    with torch.random.fork_rng(devices=[]), PeakMeter(_meter_device(accelerator)) as meter:
        loss = copy_(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return meter.peak_bytes


def _meter_device(accelerator: Accelerator) -> torch.device:
    return accelerator.device if accelerator.device.type == "cuda" else torch.device("cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="float64 makes the losses with and without remat comparable bit for bit")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=500)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="per process")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cpu", action="store_true", help="train on CPU (MULTI_CPU over gloo when launched with "
                        "several processes)")
    parser.add_argument("--compare", action="store_true", help="measure one unmodified step first; print the saving")
    parser.add_argument("--json", metavar="OUT", help="write each rank's results to OUT.rank<N>.json")
    parser.add_argument("--auto-batch-size", nargs="?", const="max", choices=["max", "throughput"],
                        help="choose the batch size that fits the budget (default: REMAT_AUTO_BATCH_SIZE decides)")
    opts = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    accelerator = Accelerator(cpu=opts.cpu)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise SystemExit(f"accelerate_gpt2: {launched} processes were launched but Accelerate runs each alone "
                         f"({accelerator.distributed_type}); on a machine without GPUs pass --cpu")
    set_seed(0)
    model = build_model(opts)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, opts.vocab_size, (opts.steps * opts.batch_size * accelerator.num_processes, opts.seq_len),
                           generator=g)
    loader = DataLoader(TensorDataset(tokens), batch_size=opts.batch_size)  # each rank gets its share

    baseline = None
    if opts.compare:
        baseline = unmodified_peak(model, opts, accelerator, tokens[: opts.batch_size].to(accelerator.device))
    # REMAT_BUDGET decides; no budget here.  auto_batch_size None: REMAT_AUTO_BATCH_SIZE decides.
    model = remat_accelerate.prepare(accelerator, model, auto_batch_size=opts.auto_batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    optimizer = accelerator.prepare(optimizer)
    hook = remat_accelerate.find_hook(model)
    # Auto batch size off: opts.batch_size comes back, nothing runs.  On: every rank must call it (collectives).
    first = tokens[: opts.batch_size].to(accelerator.device)
    batch_size = remat_accelerate.choose_batch_size(accelerator, model, ((), {"input_ids": first, "labels": first}),
                                                    default=opts.batch_size)
    if batch_size != opts.batch_size:
        loader = remat_accelerate.rebuild_dataloader(accelerator, loader, batch_size)
    else:
        loader = accelerator.prepare(loader)
    choice = hook.batch_size_choice if hook is not None else None
    if choice is not None and accelerator.is_main_process:
        print(f"auto batch size: {batch_size} per process (--batch-size {opts.batch_size}); {choice.summary()}")

    losses: list[float] = []
    peaks: list[int] = []
    batch_sizes: list[int] = []
    for (ids,) in loader:
        with PeakMeter(_meter_device(accelerator)) as meter:
            losses.append(train_step(model, optimizer, accelerator, ids))
        peaks.append(meter.peak_bytes)
        batch_sizes.append(ids.shape[0])

    session = hook.session if hook is not None else None
    budget_bytes = parse_budget(hook.config.budget, accelerator.device) if hook is not None else None
    if accelerator.is_main_process:
        report(accelerator, session, losses, peaks, budget_bytes, baseline,
               baseline_batch=opts.batch_size if batch_size != opts.batch_size else None)
    if opts.json:
        result = {
            "rank": accelerator.process_index, "world_size": accelerator.num_processes, "pid": os.getpid(),
            "distributed_type": str(accelerator.distributed_type), "losses": losses, "peaks": peaks,
            "budget_bytes": budget_bytes, "unmodified_peak": baseline,
            "plan": session.plan.to_json() if session is not None and session.plan is not None else None,
            "plans": {k: p.to_json() for k, p in session.plans.items()} if session is not None else {},
            "n_solved": session.n_solved if session is not None else 0,
            "batch_size": batch_size, "batch_sizes": batch_sizes,
            "batch_size_choice": choice.summary() if choice is not None else None,
            "batch_size_trial_peak": choice.measured_peak_bytes if choice is not None else None,
        }
        with open(f"{opts.json}.rank{accelerator.process_index}.json", "w") as f:
            json.dump(result, f)


def report(accelerator: Accelerator, session, losses: list[float], peaks: list[int], budget_bytes: int | None,
           baseline: int | None, baseline_batch: int | None = None) -> None:
    """``baseline_batch``: the batch size of the unmodified step, when auto batch size trained at another."""
    where = f"{accelerator.num_processes} process(es), {accelerator.distributed_type}"
    if session is None or session.plan is None:
        print(f"remat off (no REMAT_BUDGET); {where}")
    else:
        print(f"remat on, budget {human_bytes(budget_bytes or 0)}; {where}; plans solved here: {session.n_solved}")
        print(session.plan.table())
    for step, (loss, peak) in enumerate(zip(losses, peaks)):
        print(f"step {step}: loss {loss:.4f}  measured peak {human_bytes(peak)}")
    if baseline is not None and baseline_batch is not None:  # not the same batch size: no saving to compute
        print(f"unmodified step peak {human_bytes(baseline)} at --batch-size {baseline_batch} (one step of a copy, "
              f"without DDP); largest step peak here {human_bytes(max(peaks))} at the chosen batch size")
    elif baseline is not None:  # measured on a copy, in this process alone: DDP's own buffers are not in it
        saved = baseline - max(peaks)
        print(f"unmodified step peak {human_bytes(baseline)} (one step of a copy, without DDP); largest step peak "
              f"here {human_bytes(max(peaks))}: memory saved {human_bytes(saved)} ({saved / baseline:.0%})")


if __name__ == "__main__":
    main()
