"""Train a tiny GPT-2 with Lightning and ``AutoRemat``; print the plan and the memory saved.

    python examples/lightning_gpt2.py --config configs/gpt2_tiny.yaml [key=value ...]

Overrides use the config's dotted keys: ``trainer.devices=2 trainer.strategy=ddp``,
``remat.budget=200MiB``.  With ``remat.budget: null`` the budget is ``example.budget_share``
of the largest step peak of a run without AutoRemat, measured first.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from remat_plugin.capture.memory_meter import PeakMeter
from remat_plugin.errors import human_bytes
from remat_plugin.integrations.lightning import AutoRemat
from remat_plugin.runtime.config import RematConfig


@dataclass
class ModelOptions:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    vocab_size: int = 1000
    n_positions: int = 256
    dropout: float = 0.1
    lr: float = 1e-3


@dataclass
class DataOptions:
    batch_size: int = 8
    seq_lens: list[int] = field(default_factory=lambda: [64, 128, 256])
    batches_per_len: int = 2
    seed: int = 0


@dataclass
class TrainerOptions:
    max_steps: int = 6
    accelerator: str = "cpu"
    devices: int = 1
    strategy: str = "auto"
    precision: str = "32-true"
    seed: int = 0


@dataclass
class ExampleOptions:
    budget_share: float = 0.5
    compare_unmodified: bool = True
    remat: bool = True  # false: only the run without AutoRemat
    auto_batch_size: bool = False  # AutoRemat raises data.batch_size to the largest that fits the budget
    multiple_of: int = 1  # ... a multiple of this
    out: str | None = None


@dataclass
class Options:
    model: ModelOptions = field(default_factory=ModelOptions)
    data: DataOptions = field(default_factory=DataOptions)
    trainer: TrainerOptions = field(default_factory=TrainerOptions)
    remat: dict[str, Any] = field(default_factory=dict)  # checked by RematConfig.from_dict
    example: ExampleOptions = field(default_factory=ExampleOptions)


class GPT2Lit(pl.LightningModule):
    """A GPT-2 language model built from a config (never downloaded)."""

    def __init__(self, n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=256, dropout=0.1, lr=1e-3):
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        self.save_hyperparameters()
        config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                            n_positions=n_positions, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                            use_cache=False)  # a training step has no use for the key/value cache
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True, batch_size=batch.shape[0])
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class TokenData(pl.LightningDataModule):
    """Random token batches whose length steps through ``seq_lens``; each rank draws its own."""

    def __init__(self, batch_size=8, seq_lens=(64, 128, 256), batches_per_len=2, seed=0, vocab_size=1000):
        super().__init__()
        self.batch_size, self.seq_lens, self.batches_per_len = batch_size, list(seq_lens), batches_per_len
        self.seed, self.vocab_size = seed, vocab_size

    def train_dataloader(self):
        rank = self.trainer.global_rank if self.trainer is not None else 0
        g = torch.Generator().manual_seed(self.seed * 1000 + rank)
        batches = [torch.randint(0, self.vocab_size, (self.batch_size, n), generator=g)
                   for n in self.seq_lens for _ in range(self.batches_per_len)]
        return DataLoader(batches, batch_size=None)  # items are whole batches


class StepRecorder(pl.Callback):
    """Loss and peak memory of each training batch: forward, backward and optimizer step, planning included."""

    def __init__(self):
        self.losses: list[float] = []
        self.peaks: list[int] = []
        self.batch_sizes: list[int] = []
        self._meter: PeakMeter | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._meter = PeakMeter(pl_module.device if pl_module.device.type == "cuda" else "cpu")
        self._meter.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert self._meter is not None
        self._meter.__exit__(None, None, None)
        self.peaks.append(self._meter.peak_bytes)
        self.batch_sizes.append(int(batch.shape[0]))
        self.losses.append(float(outputs["loss"]))


def load_options(path: str | None, overrides: list[str]) -> Options:
    """The config file merged over the defaults; an unknown key anywhere is an error that names it."""
    conf = OmegaConf.structured(Options)
    if path:
        conf = OmegaConf.merge(conf, OmegaConf.load(path))
    conf = OmegaConf.merge(conf, OmegaConf.from_dotlist(overrides))
    options: Options = OmegaConf.to_object(conf)  # type: ignore[assignment]
    return options


def train(options: Options, callbacks: list[pl.Callback], max_steps: int | None = None, ckpt_path: str | None = None,
          **trainer_kwargs):
    """One ``Trainer.fit`` of a freshly seeded model (resumed from ``ckpt_path`` if given); returns trainer and model."""
    t = options.trainer
    pl.seed_everything(t.seed, verbose=False)
    model = GPT2Lit(**vars(options.model))
    data = TokenData(vocab_size=options.model.vocab_size, **vars(options.data))
    trainer = pl.Trainer(max_steps=max_steps or t.max_steps, accelerator=t.accelerator, devices=t.devices,
                         strategy=t.strategy, precision=t.precision, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         **{"enable_checkpointing": False, **trainer_kwargs})
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path, weights_only=False)
    return trainer, model


def main(argv: list[str] | None = None) -> None:
    try:
        _run(argv)
    finally:
        # Lightning leaves the process group up; gloo's threads still joinable at interpreter exit aborted a rank
        # ("terminate called without an active exception") after training had finished.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run(argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="YAML config (configs/gpt2_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)
    options = load_options(args.config, args.overrides)
    logging.basicConfig(level=logging.WARNING)
    remat = RematConfig.from_dict({k: v for k, v in options.remat.items() if v is not None})

    unmodified = StepRecorder()
    if options.example.compare_unmodified or not options.example.remat or options.remat.get("budget") is None:
        trainer, _ = train(options, [unmodified])
        if not options.example.remat:
            _write(options.example.out, trainer, {"losses": unmodified.losses, "peaks": unmodified.peaks})
            return
    budget = options.remat.get("budget") or int(options.example.budget_share * max(unmodified.peaks))

    recorder = StepRecorder()
    auto = AutoRemat(budget=budget, seq_bucket=remat.seq_bucket, cache_dir=remat.cache_dir,
                     ilp_time_limit_s=remat.ilp_time_limit_s, auto_batch_size=options.example.auto_batch_size,
                     multiple_of=options.example.multiple_of)
    trainer, _ = train(options, [auto, recorder])
    rank = trainer.global_rank
    if rank == 0:
        session = auto.session
        assert session is not None
        shown = human_bytes(budget) if isinstance(budget, int) else budget
        print(f"budget {shown} per training step; {len(session.plans)} plans (one per sequence-length bucket)")
        for step, (loss, peak) in enumerate(zip(recorder.losses, recorder.peaks)):
            was = f" (without AutoRemat {human_bytes(unmodified.peaks[step])})" if unmodified.peaks else ""
            print(f"step {step}: loss {loss:.4f}  measured peak {human_bytes(peak)}{was}")
        if unmodified.peaks:
            saved = max(unmodified.peaks) - max(recorder.peaks)
            print(f"memory saved: {human_bytes(saved)} ({saved / max(unmodified.peaks):.0%} of the largest "
                  f"unmodified step peak); losses equal to the run without AutoRemat: "
                  f"{recorder.losses == unmodified.losses}")
    session = auto.session
    assert session is not None
    _write(options.example.out, trainer, {
        "losses": recorder.losses, "peaks": recorder.peaks, "budget": budget, "n_solved": session.n_solved,
        "batch_sizes": recorder.batch_sizes,
        "choice": auto.batch_size_choice.summary() if auto.batch_size_choice else None,
        "plans": {k: p.to_json() for k, p in session.plans.items()}})


def _write(out: str | None, trainer: pl.Trainer, results: dict[str, Any]) -> None:
    """Per-rank results for tests and scripts: ``<out>.rank<N>.json``."""
    if out:
        with open(f"{out}.rank{trainer.global_rank}.json", "w") as f:
            json.dump({"rank": trainer.global_rank, "world_size": trainer.world_size, "pid": os.getpid(), **results}, f)


if __name__ == "__main__":
    main()
