"""Lightning: ``Trainer(callbacks=[AutoRemat(budget="80%")])``.

The callback is thin: it picks the module to rewrite, puts a :class:`~remat_plugin.runtime.session.RematSession`
dispatcher in place of its forward in ``setup``, and restores it in ``teardown``.  The session
plans on the first training call (the real batch, already on the device, inside the first
step), re-plans per shape bucket and keeps plans in the callback's checkpoint state.  No module
is replaced or wrapped, so ``state_dict`` keys, ``Parameter`` objects and checkpoints are
exactly those of the run without the callback.

Sharding: under ``ModelParallelStrategy`` the LightningModule's ``configure_model`` applies
``fully_shard`` after the callbacks' ``setup``, so the callback waits for ``on_fit_start`` and then
plans each sharded layer of the target under a per-rank budget
(:class:`~remat_plugin.runtime.fsdp_units.FsdpRemat`, NOTE [FSDP2 units]).  ``FSDPStrategy`` (FSDP1)
and DeepSpeed are refused at setup.

Precision: Lightning's ``32``/``64``/``16``/``bf16`` ``-true`` and ``-mixed`` settings.  Under
``-mixed`` the session plans the step as it runs inside Lightning's autocast block (the casts are
ops of the plan, the signature includes the autocast state); ``16-mixed``'s GradScaler scales the
loss outside the planned step.  Other precision plugins (Transformer Engine's fp8, bitsandbytes)
are refused at setup.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BatchSizeFinder
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_warn
from torch import nn

from remat_plugin.batch_size.search import BatchSizeChoice
from remat_plugin.batch_size.tune import tune_batch_size
from remat_plugin.capture.forward_swap import ForwardSwap
from remat_plugin.capture.memory_meter import warm_backward_workspaces
from remat_plugin.capture.segments import MAX_SEGMENTS
from remat_plugin.errors import OptionError, RematError, human_bytes
from remat_plugin.integrations.checkpointing import settle_checkpointing
from remat_plugin.ir.plan import Plan
from remat_plugin.planning.menus import DEFAULT_ILP_TIME_LIMIT_S
from remat_plugin.runtime.compiled_models import refuse_compiled
from remat_plugin.runtime.config import RematConfig
from remat_plugin.runtime.fsdp_units import FsdpRemat, leaf_units
from remat_plugin.runtime.session import RematSession
from remat_plugin.runtime.signature import BucketPolicy, describe

SUPPORTED_PRECISION = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")


def _calls_self(pl_module: pl.LightningModule) -> bool:
    """Whether ``training_step`` runs the LightningModule's own forward (``self(...)``)."""
    if type(pl_module).forward is pl.LightningModule.forward:
        return False
    try:
        source = inspect.getsource(type(pl_module).training_step)
    except (OSError, TypeError):
        return False
    return "self(" in source or "self.forward(" in source


def pick_target(pl_module: pl.LightningModule, name: str | None) -> tuple[str, nn.Module]:
    """The module to rewrite: ``name`` ("" = the LightningModule), else the one ``training_step`` runs."""
    if name is not None:
        try:
            return name, pl_module.get_submodule(name) if name else pl_module
        except AttributeError:
            names = ", ".join(repr(n) for n, _ in pl_module.named_children()) or "none"
            raise RematError(f"remat_plugin.lightning: {type(pl_module).__name__} has no submodule {name!r}; "
                             f"its children are {names} (or pass module=None to pick the largest)") from None
    if _calls_self(pl_module):
        return "", pl_module
    children = [(sum(p.numel() for p in m.parameters()), n, m) for n, m in pl_module.named_children()]
    if not children:
        return "", pl_module
    _, best_name, best = max(children, key=lambda c: c[0])
    return best_name, best


def _shards(strategy: object) -> bool:
    """Lightning's FSDP2 strategy: ``configure_model`` applies ``fully_shard``, after the callbacks' setup."""
    return type(strategy).__name__ == "ModelParallelStrategy"


def _quiet(message: str) -> None:
    """Where ``verbose=False`` sends what would be said at INFO."""


def _shown(budget: int | str) -> str:
    return human_bytes(budget) if isinstance(budget, int) else budget


class AutoRemat(pl.Callback):
    """Fit each training step into ``budget`` by planned rematerialization of one module.

    Args:
        budget: what one training step may add to allocated memory: bytes, ``"12GiB"``, or
            ``"80%"`` of free device memory when the step is planned. Optimizer state the
            first ``optimizer.step()`` will create is taken out of it, and a safety margin.
        module: attribute path of the module to rewrite (``"model"``); ``""`` for the
            LightningModule itself; ``None`` picks the module ``training_step`` calls
            ``self(...)`` on, else the child with the most parameters.
        seq_bucket: how sequence lengths round up into plan buckets (``"pow2"``, a multiple, ``None``).
        cache_dir: also keep plans in this directory, for new runs of the same model.
        ilp_time_limit_s: time cap of each block ILP solve.
        auto_batch_size: before training, set the batch size to the largest whose best plan fits
            the budget (``True`` or ``"max"``), or to the one with the most predicted samples per
            second (``"throughput"``); planned from the first batch, verified by one real step.
        batch_arg_name: the attribute (on the model, its hparams or the datamodule) holding the
            training batch size, set the Lightning way; the eval batch size is left alone.
        multiple_of, max_val: the chosen batch size is a multiple of ``multiple_of``, at most ``max_val``.
        verbose: a progress bar while a plan is made (on a terminal) and, through Lightning's logger on
            rank 0, what is rewritten and one line per new plan; False: warnings only.
        backward_segments: the planned backward hands autograd its gradients in up to this many steps, so
            DDP's buckets all-reduce while it still computes; 1: all at the end, in one autograd node.
    """

    def __init__(self, budget: int | str = "80%", module: str | None = None, *, seq_bucket: BucketPolicy = "pow2",
                 cache_dir: str | None = None, ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S, auto_batch_size: bool | str = False,
                 batch_arg_name: str = "batch_size", multiple_of: int = 1, max_val: int | None = None,
                 verbose: bool = True, compile: bool = False, backward_segments: int = MAX_SEGMENTS):
        try:  # every option is checked now, not at the first batch
            self.config = RematConfig(budget=budget, seq_bucket=seq_bucket, cache_dir=cache_dir,
                                      ilp_time_limit_s=ilp_time_limit_s, auto_batch_size=auto_batch_size,
                                      multiple_of=multiple_of, max_val=max_val, verbose=verbose, compile=compile,
                                      backward_segments=backward_segments)
        except OptionError as exc:
            raise exc.restated(stage="AutoRemat") from None
        self.module_name = module
        self.batch_arg_name = batch_arg_name
        self.batch_size_choice: BatchSizeChoice | None = None
        self.session: RematSession | None = None
        self.enabled = True
        self._swap: ForwardSwap | None = None
        self.fsdp: FsdpRemat | None = None  # under ModelParallelStrategy
        self._stored_state: dict[str, Any] | None = None
        self._unlogged: list[Plan] = []
        self._checked_use = False  # whether the first training step was seen to reach the rewritten module
        self._info: Callable[[str], Any] = rank_zero_info if verbose else _quiet

    @property
    def state_key(self) -> str:
        return self._generate_state_key(module=self.module_name)

    # --- install and remove ----------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._swap is not None:
            return
        self.check_strategy(trainer.strategy)
        if _shards(trainer.strategy):  # configure_model applies fully_shard after this: installed in on_fit_start
            return
        if any(isinstance(c, BatchSizeFinder) for c in trainer.callbacks):  # type: ignore[attr-defined]
            # Its trial steps (in its on_fit_start, which Lightning runs before ours) would each
            # plan a batch size that is then thrown away: they run the unmodified model instead.
            self._info("AutoRemat: BatchSizeFinder's trial steps run without remat; AutoRemat starts after them")
            return
        if next(pl_module.parameters(), None) is None:
            # configure_model builds the model after the callbacks' setup: rewriting now would pick the empty
            # LightningModule, whose forward training_step never calls (remat silently off)
            return
        self._install(trainer, pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _shards(trainer.strategy):
            if self.fsdp is None:
                self._install_fsdp(trainer, pl_module)
            return
        if self._swap is None and self.enabled:
            self._install(trainer, pl_module)
        if self.config.auto_batch_size and self.session is not None and self.batch_size_choice is None:
            self._choose_batch_size(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # cuBLAS's per-thread workspaces (64 MiB on an H200, released by each fit's closing empty_cache) are made
        # now, not inside the first training step: that step's rise is the plan's alone.
        if self.session is not None or self.fsdp is not None:
            warm_backward_workspaces(pl_module.device)

    def _choose_batch_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Probe the first batch, choose and verify the size, set it, and let fit rebuild the dataloader."""
        assert self.session is not None
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise RematError(f"AutoRemat: auto_batch_size needs the training batch size in an attribute; "
                             f"'{self.batch_arg_name}' is not on the model, its hparams or the datamodule "
                             "(pass batch_arg_name=...)")
        loop = trainer.fit_loop
        loop.setup_data()
        batch = next(iter(trainer.train_dataloader))  # type: ignore[arg-type]
        batch = pl_module._apply_batch_transfer_handler(batch)
        # in the context Lightning runs training steps in (64-true's default dtype, a mixed precision's autocast): a
        # search outside it planned another graph than the training steps run, which captured again
        with trainer.precision_plugin.train_step_context():
            args, kwargs = self.session.record_call(lambda: pl_module.training_step(batch, 0))
            choice = tune_batch_size(self.session, args, kwargs)  # the options of self.config, the session's
        lightning_setattr(pl_module, self.batch_arg_name, choice.batch_size)
        loop._combined_loader = None  # fit rebuilds the training dataloader with the new size
        self.batch_size_choice = choice
        self._info(f"AutoRemat: {choice.summary()}")

    @staticmethod
    def check_precision(precision: str) -> None:
        """Refuse a precision the planned step cannot reproduce (fp8 recipes, quantized weights)."""
        if str(precision) not in SUPPORTED_PRECISION:
            raise RematError(f"AutoRemat: Trainer precision {str(precision)!r} is not supported; use one of "
                             f"{', '.join(SUPPORTED_PRECISION)}, or remove AutoRemat")

    @staticmethod
    def check_strategy(strategy: object) -> None:
        """Refuse DeepSpeed (its engine owns the forward, backward and the parameters' memory) and FSDP1."""
        name = type(strategy).__name__
        if "deepspeed" in name.lower():
            raise RematError(f"AutoRemat: the {name} is not supported: DeepSpeed's engine runs the "
                             "backward and partitions the parameters itself. Use strategy='ddp' (or 'auto'), "
                             "ModelParallelStrategy with fully_shard, or remove AutoRemat")
        if name == "FSDPStrategy":
            raise RematError("AutoRemat: FSDPStrategy (FSDP1's flat parameters) is not supported. Use "
                             "ModelParallelStrategy and apply fully_shard (FSDP2) to the layers and the model in "
                             "configure_model: AutoRemat then plans each sharded layer")

    def _install_fsdp(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Under ModelParallelStrategy: plan the target's fully_shard units (NOTE [FSDP2 units])."""
        self.check_precision(trainer.precision)
        name, target = pick_target(pl_module, self.module_name)
        if not leaf_units(target):
            raise RematError(f"AutoRemat: under {type(trainer.strategy).__name__}, {type(target).__name__} has no "
                             "fully_shard unit. Apply fully_shard to its layers and then to it in configure_model, "
                             "or remove AutoRemat")
        for option, value in (("auto_batch_size", self.config.auto_batch_size), ("compile", self.config.compile)):
            if value:
                raise RematError(f"AutoRemat: {option}={value!r} is not supported with sharded (fully_shard) "
                                 "layers; remove the option")
        if not self._avoid_double_checkpointing(target):
            self.enabled = False
            return
        self.fsdp = FsdpRemat(target, self.config.budget, ilp_time_limit_s=self.config.ilp_time_limit_s)
        self._info(f"AutoRemat: planning {len(self.fsdp.unit_names)} sharded layers of "
                   f"{type(pl_module).__name__}{'.' + name if name else ''}, budget {_shown(self.config.budget)} "
                   "per rank")

    def _install(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_strategy(trainer.strategy)
        self.check_precision(trainer.precision)
        name, target = pick_target(pl_module, self.module_name)
        refuse_compiled(target, "AutoRemat(compile=True)")
        if getattr(pl_module, "_compiler_ctx", None) and target is pl_module:  # trainer.fit(torch.compile(module))
            raise RematError("AutoRemat: the LightningModule was passed to fit wrapped in torch.compile, which would "
                             "run it without the plan; pass it uncompiled and use AutoRemat(compile=True)")
        shown = f"{type(pl_module).__name__}.{name}" if name else type(pl_module).__name__
        self._info(f"AutoRemat: rewriting {shown} ({type(target).__name__}, "
                   f"{sum(p.numel() for p in target.parameters()):,} parameters), budget {_shown(self.config.budget)}")
        if not self._avoid_double_checkpointing(target):
            self.enabled = False
            return
        self.session = RematSession(target, self.config, optimizers=lambda: trainer.optimizers,
                                    on_new_plan=self._announce, report=rank_zero_info)
        if self._stored_state is not None:
            self.session.load_state_dict(self._stored_state)
        # Manual optimization calls manual_backward inside training_step, inside Lightning's autocast block.
        inside = not pl_module.automatic_optimization and str(trainer.precision).endswith("-mixed")
        self.session.resolver.execution = dataclasses.replace(self.session.resolver.execution,
                                                              backward_autocast=inside)
        self._swap = ForwardSwap(target, self.session.dispatcher)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._swap is not None:
            self._swap.restore()
            self._swap = None
        if self.fsdp is not None:
            self.fsdp.remove()
            self.fsdp = None

    def _avoid_double_checkpointing(self, target: nn.Module) -> bool:
        """Our plan replaces HF gradient checkpointing; ``CheckpointWrapper`` modules, which we cannot undo, turn us off."""
        wrapped = settle_checkpointing(target, "AutoRemat", self._info, rank_zero_warn)
        if wrapped:
            rank_zero_warn(f"AutoRemat: the model already uses CheckpointWrapper modules ({', '.join(wrapped[:3])}); "
                           "AutoRemat stays off to avoid checkpointing twice. Remove them to let AutoRemat plan "
                           "instead.")
            return False
        return True

    # --- reporting ---------------------------------------------------------------------------
    def _announce(self, plan: Plan) -> None:
        # The session says each plan in one line (report=); the table is for debugging.
        rank_zero_debug(f"AutoRemat: new plan for inputs {describe(plan.signature)}\n{plan.table()}")
        self._unlogged.append(plan)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.session is not None and not self._checked_use:
            self._checked_use = True
            if self.session.resolver.latest is None and not self.session.plans:
                rank_zero_warn(
                    f"AutoRemat: the first training step never called {type(self.session.module).__name__}'s "
                    "forward, the module AutoRemat rewrote, so it ran without remat. Pass module='...' naming the "
                    "submodule training_step calls (for example AutoRemat(module='model'))")
        while self._unlogged:
            plan = self._unlogged.pop(0)
            recomputed = sum(b.mode != "keep" for b in plan.blocks)
            pl_module.log_dict({
                "remat/budget_mib": plan.budget_bytes / 2**20,
                "remat/predicted_peak_mib": plan.predicted_peak_bytes / 2**20,
                "remat/predicted_overhead": plan.predicted_overhead,
                "remat/blocks_recomputed": float(recomputed),
                "remat/blocks_kept": float(len(plan.blocks) - recomputed),
            }, rank_zero_only=True, batch_size=1)

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.session is not None:
            return self.session.state_dict()
        return dict(self._stored_state or {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._stored_state = state_dict
        if self.session is not None:
            self.session.load_state_dict(state_dict)
