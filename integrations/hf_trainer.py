"""transformers' ``Trainer``: ``Trainer(..., callbacks=[RematCallback(budget="80%")])``, or ``REMAT_BUDGET=80%``.

The Trainer builds its own Accelerator and prepares the model inside ``train()``, so a script cannot call
:func:`~remat_plugin.integrations.accelerate.prepare`.  The callback attaches the same
:class:`~remat_plugin.integrations.accelerate.RematHook` when the Trainer is built (``on_init_end``), before
``train()`` prepares the model: mixed precision's autocast then wraps the planned step as it wraps the forward, and
DDP wraps the model with the hook on it.  The model stays the Trainer's own (a ``PreTrainedModel``), so checkpoints
are ``save_pretrained``'s, tied weights included, and load without the plugin.  Passing a
:class:`~remat_plugin.runtime.module.RematModule` to the Trainer instead trains, but the Trainer saves a module it
does not recognise as a bare state dict, which safetensors refuses for tied weights.

- Options come from the arguments, else the ``REMAT_*`` variables, as for Accelerate
  (:class:`~remat_plugin.integrations.accelerate.RematPlugin`).  With no budget from either, the callback does
  nothing and says so.
- ``gradient_checkpointing=True`` is turned off when training begins (the Trainer turns it on inside
  ``train()``), with a warning: the plan decides what is recomputed.  The key/value cache goes off as under
  Accelerate.
- The optimizer's state still to be created is taken out of the budget when a plan is made.
- DeepSpeed, FSDP (``fsdp=...``) and ``torch_compile=True`` are refused when the Trainer is built, naming the fix.
- Auto batch size is Accelerate's and Lightning's; here the Trainer's ``auto_find_batch_size`` is left to it.
"""
from __future__ import annotations

import logging
from typing import Any

from accelerate.hooks import add_hook_to_module
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from remat_plugin.errors import RematError
from remat_plugin.integrations.accelerate import RematHook, RematPlugin, find_hook
from remat_plugin.integrations.checkpointing import rank_zero_tellers, settle_checkpointing
from remat_plugin.runtime.compiled_models import refuse_compiled
from remat_plugin.runtime.config import ENV_VARIABLES, RematConfig
from remat_plugin.runtime.reporting import announce

log = logging.getLogger(__name__)

_PREFIX = "remat_plugin.hf_trainer"


class RematCallback(TrainerCallback):
    """Planned rematerialization of the Trainer's model; see the module docstring.

    Args:
        budget: the most one training step may add to allocated memory (bytes, ``"12GiB"``, ``"80%"``); None:
            ``REMAT_BUDGET``, and without it the callback is off.
        options: :class:`~remat_plugin.integrations.accelerate.RematPlugin`'s (``seq_bucket``, ``cache_dir``,
            ``ilp_time_limit_s``, ``verbose``, ``compile``, ``backward_segments``).
    """

    def __init__(self, budget: int | str | None = None, **options: Any):
        RematConfig.check_names(options, stage=_PREFIX)
        if options.get("auto_batch_size"):
            raise RematError(f"{_PREFIX}: auto_batch_size is not supported under the Trainer; use its "
                             "auto_find_batch_size, or remat_plugin's Accelerate or Lightning integration")
        explicit = {k: v for k, v in {"budget": budget, **options}.items() if v is not None}
        self.plugin = RematPlugin(**explicit)  # checks every value now, the environment's too
        self.hook: RematHook | None = None
        self._optimizer: Any = None

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: nn.Module | None = None, **kwargs: Any) -> None:
        if not self.plugin.enabled:
            if self.plugin.verbose is not False:
                announce(f"{_PREFIX}: no budget (RematCallback(budget=...) or {ENV_VARIABLES['budget']}); training "
                         "without remat", log)
            return
        if model is None:
            raise RematError(f"{_PREFIX}: the Trainer has no model (model_init is not supported); pass model=...")
        _check_supported(args)
        refuse_compiled(model, "RematCallback(..., compile=True)")
        if find_hook(model) is not None:
            raise RematError(f"{_PREFIX}: the model already has a RematHook; add one RematCallback, and do not also "
                             "call remat_plugin.integrations.accelerate.prepare on it")
        config = self.plugin.to_config()
        wrapped = settle_checkpointing(model, _PREFIX, *rank_zero_tellers(log))
        if wrapped:
            raise RematError(f"{_PREFIX}: the model already uses CheckpointWrapper modules ({', '.join(wrapped[:3])}); "
                             "remove them to let remat_plugin plan, or drop the RematCallback")
        self.hook = RematHook(config, optimizers=lambda: [self._optimizer] if self._optimizer is not None else [])
        add_hook_to_module(model, self.hook, append=True)
        if config.verbose:
            announce(f"{_PREFIX}: rewriting {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} "
                     f"parameters), budget {config.budget}", log)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: nn.Module | None = None, optimizer: Any = None, **kwargs: Any) -> None:
        if self.hook is None or model is None:
            return
        self._optimizer = optimizer
        # train() turned the model's own checkpointing on (gradient_checkpointing=True) after on_init_end
        settle_checkpointing(model, _PREFIX, *rank_zero_tellers(log))


def _check_supported(args: TrainingArguments) -> None:
    """Set-ups whose model we cannot rewrite: they shard it, own its memory, or compile it themselves."""
    budget_env = ENV_VARIABLES["budget"]
    if getattr(args, "deepspeed", None):
        raise RematError(f"{_PREFIX}: DeepSpeed is not supported; train without deepspeed=..., or without the "
                         f"RematCallback (and {budget_env})")
    if getattr(args, "fsdp", None):
        raise RematError(f"{_PREFIX}: the Trainer's FSDP is not supported; shard the layers with FSDP2 "
                         "(fully_shard) under remat_plugin.integrations.accelerate, or drop the RematCallback")
    if getattr(args, "torch_compile", False):
        raise RematError(f"{_PREFIX}: torch_compile=True compiles the model, which would run it without the plan; "
                         "use RematCallback(..., compile=True) (REMAT_COMPILE=1) to compile the planned step")

