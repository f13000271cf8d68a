"""Launched by tests/test_hf_trainer.py with ``accelerate launch`` and 2 CPU processes (gloo).

A transformers ``Trainer`` on a GPT-2 built from its config (float64, dropout on) for 3 steps; with
``REMAT_BUDGET`` set, a ``RematCallback`` takes its budget from it.  Each rank writes ``OUT/rank<N>.json``: the
logged losses, the sum of every weight, and what the callback's session planned.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from remat_plugin.integrations.accelerate import find_hook
from remat_plugin.integrations.hf_trainer import RematCallback


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(0, 500, (64,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main(out: str) -> None:
    config = GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=500, n_positions=128, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).double()
    args = TrainingArguments(output_dir=out, max_steps=3, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, learning_rate=1e-3, seed=0, data_seed=0)
    callbacks = [RematCallback(verbose=False)] if os.environ.get("REMAT_BUDGET") else []
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train()
    hook = find_hook(model)
    session = hook.session if hook is not None else None
    result = {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "weights": float(sum(p.sum() for p in model.parameters())),
        "n_solved": session.n_solved if session is not None else None,
        "plans": [p.to_json() for p in session.plans.values()] if session is not None else [],
    }
    with open(os.path.join(out, f"rank{trainer.args.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
