"""``python -m remat_plugin.bench batch-size``: our planned batch size against Lightning's BatchSizeFinder.

One process, one model, one budget ``B`` enforced by the same meter for both: a training
step whose peak (forward, backward, optimizer step) rises more than ``B`` above its start
raises the error Lightning recognises as running out of CPU memory, which is what
``BatchSizeFinder`` (mode ``binsearch``) searches against.  Reported per side: trial steps
run before training, the chosen batch size, and samples per second at that size, timed in
interleaved pairs of steps (theirs unmodified at their size, ours planned at ours).  For our
choice, the next size up (``+ multiple_of``) is planned at its smallest feasible budget and
one step of it measured, to show it does not fit ``B`` under any plan we can find.

    python -m remat_plugin.bench batch-size --budget 150MiB --json results/batch_size_cpu.json
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder
from torch.utils.data import DataLoader, Dataset

from remat_plugin.capture.memory_meter import PeakMeter, measure_peak
from remat_plugin.errors import InfeasibleBudgetError, human_bytes
from remat_plugin.integrations.lightning import AutoRemat
from remat_plugin.planning.choose_plan import make_plan
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.module import rematerialize
from remat_plugin.runtime.steps import captured_problem

log = logging.getLogger(__name__)


class _Tokens(Dataset):
    """Seeded random token sequences, generated on access (a long dataset, so no finder hits its end)."""

    def __init__(self, seq_len: int, vocab: int, n: int = 1 << 16):
        self.seq_len, self.vocab, self.n = seq_len, vocab, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(i))


class _LM(pl.LightningModule):
    def __init__(self, n_layer: int, n_embd: int, n_head: int, seq_len: int, vocab: int, batch_size: int,
                 budget: _Budget | None = None):
        super().__init__()
        self.meter = budget
        from transformers import GPT2Config, GPT2LMHeadModel

        self.batch_size, self.seq_len, self.vocab = batch_size, seq_len, vocab
        config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=seq_len, vocab_size=vocab,
                            use_cache=False, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(config)
        self.model.loss_type = "ForCausalLM"

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def on_train_batch_start(self, batch, batch_idx):
        if self.meter is not None:
            self.meter.start()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.meter is not None:
            self.meter.end(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)  # no optimizer state: the budget is the step's

    def train_dataloader(self):
        return DataLoader(_Tokens(self.seq_len, self.vocab), batch_size=self.batch_size)


class _Budget:
    """Meters every training batch; one over ``budget_bytes`` fails like an out-of-memory error.

    Called from the LightningModule's own batch hooks: ``BatchSizeFinder``'s trial steps skip
    other callbacks' batch hooks, and the trials are what must be metered.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.steps: list[tuple[int, int]] = []  # (batch size, peak bytes), trials included
        self._meter: PeakMeter | None = None

    def start(self) -> None:
        self._meter = PeakMeter("cpu")
        self._meter.__enter__()

    def end(self, batch: torch.Tensor) -> None:
        assert self._meter is not None
        self._meter.__exit__(None, None, None)
        self.steps.append((int(batch.shape[0]), self._meter.peak_bytes))
        if self._meter.peak_bytes > self.budget_bytes:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: step peak "
                               f"{self._meter.peak_bytes} exceeds the budget {self.budget_bytes}")


def _fit(module: _LM, callbacks: list, max_steps: int) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module)
    return trainer


def _step_s(model, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - t0


def run(budget_bytes: int, n_layer: int = 4, n_embd: int = 256, n_head: int = 4, seq_len: int = 256,
        vocab: int = 1000, init_val: int = 2, multiple_of: int = 4, pairs: int = 5) -> dict[str, Any]:
    """Both finders on one model and budget; returns every figure the report prints."""
    dims: dict[str, Any] = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "seq_len": seq_len,
                            "vocab": vocab}
    theirs_budget = _Budget(budget_bytes)
    finder = BatchSizeFinder(mode="binsearch", init_val=init_val, steps_per_trial=1, max_trials=25)
    t0 = time.perf_counter()
    _fit(_LM(batch_size=init_val, budget=theirs_budget, **dims), [finder], max_steps=1)
    theirs = {"batch_size": int(finder.optimal_batch_size or 0), "trial_steps": len(theirs_budget.steps) - 1,
              "wall_s": time.perf_counter() - t0}

    ours_budget = _Budget(budget_bytes)
    auto = AutoRemat(budget=budget_bytes, auto_batch_size=True, multiple_of=multiple_of)
    t0 = time.perf_counter()
    module = _LM(batch_size=init_val, budget=ours_budget, **dims)
    _fit(module, [auto], max_steps=1)
    choice = auto.batch_size_choice
    assert choice is not None
    ours = {"batch_size": choice.batch_size, "trial_steps": choice.trial_steps, "wall_s": time.perf_counter() - t0,
            "search_s": choice.search_s,
            "training_step_peak_bytes": max(p for _, p in ours_budget.steps), "summary": choice.summary(),
            "planned_sizes": [c.batch_size for c in choice.evaluated]}

    # The chosen size with every output differentiated (a search before the step-down planned that): its floor.
    ids = torch.randint(0, vocab, (choice.batch_size, seq_len), generator=torch.Generator().manual_seed(1))
    keep_all = captured_problem(_LM(batch_size=choice.batch_size, **dims).model.train(),  # type: ignore[union-attr]
                                (), {"input_ids": ids, "labels": ids})
    try:
        ours["keep_all_floor_bytes"] = make_plan(keep_all.problem, keep_all.constants, choice.budget_bytes)[0] \
            .min_feasible_bytes
    except InfeasibleBudgetError as exc:
        ours["keep_all_floor_bytes"] = exc.min_feasible_bytes
    ours["ungraded_outputs"] = list(choice.ungraded_outputs)

    # The next size up: its smallest feasible plan, and one measured step of it.
    nxt = choice.next_size
    next_info: dict[str, Any] = {}
    if nxt is not None:
        ids = torch.randint(0, vocab, (nxt.batch_size, seq_len), generator=torch.Generator().manual_seed(1))
        probe = _LM(batch_size=nxt.batch_size, **dims).model.train()  # type: ignore[union-attr]
        try:
            rm = rematerialize(probe, (), {"input_ids": ids, "labels": ids}, budget=nxt.min_feasible_bytes)
        except InfeasibleBudgetError as exc:
            rm = rematerialize(probe, (), {"input_ids": ids, "labels": ids}, budget=exc.min_feasible_bytes)
        assert rm.plan is not None
        if rm.plan.refuses_holding:
            # This process's planner put the held-logits floor a little above the search's, so the first plan
            # stepped down to freeing them: plan at that floor instead, the logits held as the search planned.
            rm = rematerialize(probe, (), {"input_ids": ids, "labels": ids}, budget=rm.plan.loss_only_floors[1])

        floor_plan = rm.plan  # the next call plans again for what held() did with the outputs
        assert floor_plan is not None

        def held() -> None:  # the outputs (logits) live to the end of backward, as the planner assumes
            out = rm(input_ids=ids, labels=ids)
            out.loss.backward()

        _, peak_held = measure_peak(held)
        _, peak_dropped = measure_peak(lambda: rm(input_ids=ids, labels=ids).loss.backward())
        next_info = {"batch_size": nxt.batch_size, "floor_bytes": nxt.min_feasible_bytes,
                     "plan_budget_bytes": floor_plan.budget_bytes, "predicted_peak_bytes": floor_plan.predicted_peak_bytes,
                     "measured_peak_bytes": peak_held, "measured_peak_logits_dropped_bytes": peak_dropped}

    # Throughput at each chosen size, in interleaved pairs of forward+backward steps.
    plain = _LM(batch_size=1, **dims).model.train()
    planned_model = _LM(batch_size=1, **dims).model.train()
    ids_t = torch.randint(0, vocab, (int(theirs["batch_size"]), seq_len), generator=torch.Generator().manual_seed(2))
    ids_o = torch.randint(0, vocab, (int(ours["batch_size"]), seq_len), generator=torch.Generator().manual_seed(3))
    rm_o = rematerialize(planned_model, (), {"input_ids": ids_o, "labels": ids_o}, budget=choice.budget_bytes)
    for _ in range(3):  # a loop's first steps: calibration, then the re-plan for the dropped logits; not timed
        _step_s(rm_o, ids_o)
    t_theirs, t_ours = [], []
    for i in range(pairs + 1):
        a, b = _step_s(plain, ids_t), _step_s(rm_o, ids_o)
        if i:  # the first pair warms up
            t_theirs.append(a)
            t_ours.append(b)
    theirs["samples_per_s"] = theirs["batch_size"] / statistics.median(t_theirs)
    ours["samples_per_s"] = ours["batch_size"] / statistics.median(t_ours)
    return {"budget_bytes": budget_bytes, "model": dims, "multiple_of": multiple_of, "pairs": pairs,
            "theirs": theirs, "ours": ours, "next_size": next_info}


def format_report(r: dict[str, Any]) -> str:
    t, o, n = r["theirs"], r["ours"], r["next_size"]
    lines = [
        f"budget {human_bytes(r['budget_bytes'])}, GPT-2 {r['model']}",
        "",
        "| finder | trial steps | batch size | samples/s at it | wall s |",
        "|---|---|---|---|---|",
        (f"| Lightning BatchSizeFinder (binsearch, no remat) | {t['trial_steps']} | {t['batch_size']} | "
         f"{t['samples_per_s']:.1f} | {t['wall_s']:.1f} |"),
        (f"| remat_plugin AutoRemat(auto_batch_size=True) | {o['trial_steps']} | {o['batch_size']} | "
         f"{o['samples_per_s']:.1f} | {o['wall_s']:.1f} |"),
        "",
        (f"ours / theirs: batch size {o['batch_size'] / t['batch_size']:.2f}x, samples/s "
         f"{o['samples_per_s'] / t['samples_per_s']:.2f}x (median of {r['pairs']} interleaved step pairs); "
         f"our first training step peaked at {human_bytes(o['training_step_peak_bytes'])}; the search with its "
         f"verification step took {o['search_s']:.1f} s of our wall time (the rest: the trainer and its one step)."),
    ]
    if o["ungraded_outputs"]:
        fits = "within" if o["keep_all_floor_bytes"] <= r["budget_bytes"] else "above"
        lines.append(f"sizes planned with output(s) {o['ungraded_outputs']} held without a gradient, as the first plan "
                     f"steps down to; with every output differentiated, size {o['batch_size']}'s planner floor is "
                     f"{human_bytes(o['keep_all_floor_bytes'])}, {fits} the budget.")
    if n:
        lines.append(f"next size {n['batch_size']}: planner floor {human_bytes(n['floor_bytes'])}; its smallest "
                     f"feasible plan predicts {human_bytes(n['predicted_peak_bytes'])}; one step of it measured "
                     f"{human_bytes(n['measured_peak_bytes'])} with the outputs held through backward (the "
                     f"planner's assumption), {human_bytes(n['measured_peak_logits_dropped_bytes'])} when the "
                     "caller drops the logits before backward.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m remat_plugin.bench batch-size",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="150MiB", help="the step budget both finders must respect")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1000, help="the GPT-2 vocabulary (the logits' width)")
    parser.add_argument("--multiple-of", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    budget = parse_budget(opts.budget)
    result = run(budget, n_layer=opts.n_layer, n_embd=opts.n_embd, seq_len=opts.seq_len, vocab=opts.vocab,
                 multiple_of=opts.multiple_of, pairs=opts.pairs)
    print(format_report(result))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
