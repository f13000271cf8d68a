"""Accelerate: ``model = prepare(accelerator, model, budget="80%")``, or ``REMAT_BUDGET=80% accelerate launch``.

:func:`prepare` runs ``accelerator.prepare(model)`` and attaches a :class:`RematHook` to the
underlying module with ``add_hook_to_module(..., append=True)``, so it composes with Accelerate's
own hooks.  The hook is thin: ``add_hook_to_module`` keeps the real forward in
``module._old_forward`` before it calls ``init_hook``, and calls ``_old_forward`` after every
hook's ``pre_forward``; ``init_hook`` puts a :class:`~remat_plugin.runtime.session.RematSession`
dispatcher there and ``detach_hook`` puts the real forward back.  The session plans on the first
training call (the real batch, after the other hooks moved it), re-plans per shape bucket, and
with several processes rank 0 plans and every rank runs the same plan.  No module is replaced,
so ``state_dict`` keys, ``Parameter`` objects and ``save_state`` checkpoints are those of the run
without the hook; the plans travel next to them as ``remat_plans.json``.

The hook goes on after ``accelerator.prepare``, so it wraps whatever forward Accelerate put in
place and removing it gives exactly that back.  Planning captures the module with
``torch.export``, which calls it once more; that call reaches the real forward directly, not the hooks
and wrappers around ours (the arguments it traces are those the hooks' ``pre_forward`` already gave the
planned call; see ``runtime/dispatch.py``).

Options come from arguments, a :class:`RematPlugin`, or the environment (``REMAT_BUDGET``,
``REMAT_SEQ_BUCKET``, ``REMAT_CACHE_DIR``, ``REMAT_ILP_TIME_LIMIT_S``, ``REMAT_AUTO_BATCH_SIZE``,
``REMAT_BATCH_MULTIPLE_OF``, ``REMAT_MAX_BATCH_SIZE``, ``REMAT_VERBOSE``, ``REMAT_COMPILE``:
:data:`~remat_plugin.runtime.config.ENV_VARIABLES`),
in that order, into one :class:`~remat_plugin.runtime.config.RematConfig`, which checks them.  With no
budget anywhere, :func:`prepare` is plain ``accelerator.prepare(model)``.

Mixed precision (``--mixed_precision bf16|fp16``): ``accelerator.prepare`` wraps the model's forward
in autocast (outputs to fp32); the session takes that wrapped forward's place, so it is wrapped the
same way (:func:`_mixed_precision_forward`) and plans the step as it runs under autocast.  fp8 is
refused.  A compiled model (``dynamo_backend``, ``torch.compile``) is refused naming ``REMAT_COMPILE=1``,
which compiles the planned step instead.

FSDP2: with ``fsdp_version: 2`` (Accelerate shards the layers: ``fsdp_auto_wrap_policy:
TRANSFORMER_BASED_WRAP``), or a model the script has ``fully_shard``-ed itself (prepared with its
optimizer first, ``model, opt = accelerator.prepare(model, opt)``, or not at all), :func:`prepare` puts a
:class:`~remat_plugin.runtime.fsdp_units.FsdpRemat` on the model instead of the hook: each sharded layer
runs a planned step under a per-rank budget (NOTE [FSDP2 units]); :func:`find_fsdp` returns it.
FSDP1 (``fsdp_version: 1``) and DeepSpeed are refused.  Accelerate turns FSDP on only on GPUs; on CPU
the script's own ``fully_shard`` path is tested (``tests/test_fsdp.py``).

Output: Accelerate sets up no logging handler, so what the main process says (what is rewritten,
one line per new plan, the batch size chosen) goes to stderr through ``remat_plugin``'s default
handler (:mod:`remat_plugin.runtime.reporting`) unless the script configures logging;
``verbose=False`` (or ``REMAT_VERBOSE=0``) leaves warnings only.

Auto batch size: :func:`prepare` still returns only the model; with ``auto_batch_size`` on (an
argument, the plugin, or ``REMAT_AUTO_BATCH_SIZE=1``), :func:`choose_batch_size` plans the
largest per-process batch whose best plan fits the budget (every rank gets the same size) and
:func:`rebuild_dataloader` makes the training dataloader over the same dataset with it::

    model = prepare(accelerator, model)
    optimizer = accelerator.prepare(optimizer)
    batch_size = choose_batch_size(accelerator, model, ((), {"input_ids": ids, "labels": ids}), default=8)
    loader = rebuild_dataloader(accelerator, loader, batch_size)  # the unprepared DataLoader, or a prepared one

With auto batch size off, :func:`choose_batch_size` returns ``default`` and does nothing else.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard
from accelerate.hooks import ModelHook, SequentialHook, add_hook_to_module
from accelerate.utils import (
    DistributedType,
    DynamoBackend,
    convert_outputs_to_fp32,
    extract_model_from_parallel,
    get_mixed_precision_context_manager,
    send_to_device,
)
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset

from remat_plugin.batch_size.search import BatchSizeChoice
from remat_plugin.batch_size.tune import tune_batch_size
from remat_plugin.capture.forward_swap import InstalledForward
from remat_plugin.capture.memory_meter import warm_backward_workspaces
from remat_plugin.errors import OptionError, RematError
from remat_plugin.integrations.checkpointing import rank_zero_tellers, settle_checkpointing
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.compiled_models import refuse_compiled
from remat_plugin.runtime.config import ENV_VARIABLES, ConfigError, RematConfig, env_texts
from remat_plugin.runtime.dist import is_rank_zero
from remat_plugin.runtime.fsdp_units import FsdpRemat, leaf_units
from remat_plugin.runtime.optimizer_state import unwrap
from remat_plugin.runtime.reporting import announce
from remat_plugin.runtime.session import RematSession
from remat_plugin.runtime.signature import describe

log = logging.getLogger(__name__)

# Accelerate set-ups whose module we cannot (yet) rewrite: they own the model's memory or compile it themselves.
SUPPORTED_MIXED_PRECISION = ("no", "bf16", "fp16")  # fp8 recipes (Transformer Engine, MS-AMP, torchao) are not
_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)
_BUDGET_ENV = ENV_VARIABLES["budget"]


@dataclass
class RematPlugin:
    """Remat options for :func:`prepare`: :class:`RematConfig`'s, where ``None`` means unset.

    Like Accelerate's own plugins, it reads the environment in ``__post_init__``: a field left
    ``None`` is filled from its variable (:data:`~remat_plugin.runtime.config.ENV_VARIABLES`), so
    the launch flag (``REMAT_BUDGET=80% accelerate launch``) reaches a script that never names a
    budget.  A budget that is still ``None`` leaves the plugin off.  What each option means and
    which values it takes is :class:`RematConfig`'s, which checks them all here.
    """

    # The most one training step may add to allocated memory; None: off (not RematConfig's 80%).
    budget: int | str | None = None
    # How sequence lengths round up into plan buckets; "exact" for no rounding (None here means unset).
    seq_bucket: int | str | None = None
    # Directory where plans are also kept, so a new run of the same model does not solve again.
    cache_dir: str | None = None
    # Time cap of each block ILP solve, seconds.
    ilp_time_limit_s: float | None = None
    # What choose_batch_size does: True or "max", "throughput", or False (the script's own size).
    auto_batch_size: bool | str | None = None
    # The chosen batch size is a multiple of this (REMAT_BATCH_MULTIPLE_OF); None: 1.
    multiple_of: int | None = None
    # ... and at most this (REMAT_MAX_BATCH_SIZE); None: no limit.
    max_val: int | None = None
    # Progress bar and one line per new plan (REMAT_VERBOSE); None: True.
    verbose: bool | None = None
    # Run the planned step as inductor kernels (REMAT_COMPILE); None: False.
    compile: bool | None = None
    # Gradients handed to autograd in up to this many steps of the backward (REMAT_BACKWARD_SEGMENTS); None: 8.
    backward_segments: int | None = None

    def __post_init__(self) -> None:
        explicit = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        try:  # every value is checked here, at construction, not at the first batch
            config = RematConfig.from_env(**explicit)
        except OptionError as exc:
            raise _in_our_words(exc) from None
        for name in explicit.keys() | env_texts().keys():  # the fields set, normalised; the others stay None
            value = getattr(config, name)
            setattr(self, name, "exact" if name == "seq_bucket" and value is None else value)

    @property
    def enabled(self) -> bool:
        return self.budget is not None

    @property
    def auto_batch_mode(self) -> str | None:
        """The auto batch size objective ("max" or "throughput"), or None when it is off."""
        return str(self.auto_batch_size) if self.auto_batch_size else None

    def to_config(self) -> RematConfig:
        """The options, all of them; needs a budget (an argument, this plugin's field, or ``REMAT_BUDGET``)."""
        if self.budget is None:
            raise ConfigError(option="budget", stage="remat_plugin.accelerate",
                              reason=f"no budget: pass budget=... or set {_BUDGET_ENV}")
        return RematConfig.from_dict({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                      if getattr(self, f.name) is not None})


def _in_our_words(exc: OptionError) -> OptionError:
    """A config error as this integration says it: an unset ``REMAT_BUDGET`` turns remat off here, not 80%."""
    if exc.variable == _BUDGET_ENV:
        return exc.restated(stage="remat_plugin.accelerate",
                            fix=f"Fix {exc.variable}, or unset it to train without remat.")
    return exc.restated(stage="remat_plugin.accelerate")


class RematHook(ModelHook):
    """Planned rematerialization of the module it is attached to; see the module docstring.

    Attach with ``add_hook_to_module(module, hook, append=True)``; ``remove_hook_from_module``
    restores the original forward.  ``pre_forward``/``post_forward`` pass through: the session sits
    in ``module._old_forward``, where it sees the arguments after every hook's ``pre_forward``.

    Args:
        config: every option, auto batch size included (what :func:`choose_batch_size` does).
        optimizers: returns the optimizers of the module's parameters, called when a plan is
            made: state they have not created yet is taken out of the budget.
        wrap_forward: wraps the session's forward as Accelerate wrapped the module's (mixed precision's
            autocast and fp32 outputs), since the session replaces that wrapped forward.
        auto_batch_size, multiple_of, max_val: kept for older callers; when given (not None) they
            replace the config's, and :class:`RematConfig` checks them.
    """

    def __init__(self, config: RematConfig | None = None, *, optimizers: Callable[[], Iterable] = tuple,
                 auto_batch_size: bool | str | None = None, multiple_of: int | None = None, max_val: int | None = None,
                 wrap_forward: Callable[[Callable], Callable] | None = None):
        given: dict[str, Any] = {"auto_batch_size": auto_batch_size, "multiple_of": multiple_of, "max_val": max_val}
        self.config = dataclasses.replace(config or RematConfig(), **{k: v for k, v in given.items() if v is not None})
        self.optimizers = optimizers
        self.wrap_forward = wrap_forward
        self.batch_size_choice: BatchSizeChoice | None = None  # set by choose_batch_size
        self.session: RematSession | None = None
        self._real_forward: Callable | None = None
        self._dispatch: Callable | None = None
        self._stored_state: dict[str, Any] | None = None

    @property
    def auto_batch_size(self) -> str | None:
        """What :func:`choose_batch_size` does: "max", "throughput", or None (off: the script's batch size)."""
        return str(self.config.auto_batch_size) if self.config.auto_batch_size else None

    @property
    def attached(self) -> bool:
        return self._dispatch is not None

    def init_hook(self, module: nn.Module) -> nn.Module:
        real = module.__dict__.get("_old_forward")
        if real is None:
            raise RematError("remat_plugin.accelerate: RematHook.init_hook found no module._old_forward; attach the "
                             "hook with accelerate.hooks.add_hook_to_module(module, hook, append=True)")
        # Called again when another hook is appended later (Accelerate detaches, then re-inits all): plans stay.
        if self.session is None or self.session.module is not module:
            self.session = RematSession(module, self.config, optimizers=self.optimizers, on_new_plan=self._announce)
            if self._stored_state is not None:
                self.session.load_state_dict(self._stored_state)
        self._real_forward = real
        dispatch = self.session.dispatcher(real)
        if self.wrap_forward is not None:
            dispatch = self.wrap_forward(dispatch)
        # A deep copy of the module (an EMA model) takes the forward below ours, bound to the copy, and a plain hook
        # (NOTE [copies of a module we run]): it used to run this module's parameters.
        self._dispatch = InstalledForward(dispatch, module, real)
        module._old_forward = self._dispatch  # type: ignore[assignment]
        return module

    def __reduce__(self):
        return ModelHook, ()  # a copy of the module runs plain (NOTE [copies of a module we run])

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if self._dispatch is not None:
            if module.__dict__.get("_old_forward") is self._dispatch:
                module._old_forward = self._real_forward  # type: ignore[assignment]
            else:  # a hook attached after ours wrapped our dispatcher; Accelerate restores the forward below it
                log.warning("remat_plugin.accelerate: module._old_forward was replaced after RematHook was attached; "
                            "leaving it as it is")
        self._dispatch = self._real_forward = None
        return module

    def _announce(self, plan: Plan) -> None:
        # The session says each plan in one line; the table is for debugging.
        if is_rank_zero():
            log.debug("remat_plugin.accelerate: new plan for inputs %s\n%s", describe(plan.signature), plan.table())

    # --- checkpoints: what register_for_checkpointing and the save/load pre-hooks call ------------
    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict() if self.session is not None else dict(self._stored_state or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._stored_state = state
        if self.session is not None:
            self.session.load_state_dict(state)


def find_hook(model: nn.Module) -> RematHook | None:
    """The :class:`RematHook` on ``model`` (as :func:`prepare` returned it, DDP-wrapped or not), if any."""
    module = extract_model_from_parallel(model, keep_torch_compile=False)
    pending = [getattr(module, "_hf_hook", None)]
    while pending:
        hook = pending.pop()
        if isinstance(hook, RematHook):
            return hook
        if isinstance(hook, SequentialHook):
            pending.extend(hook.hooks)
    return None


def prepare(accelerator: Accelerator, model: nn.Module, budget: int | str | None = None,
            plugin: RematPlugin | None = None, **options: Any) -> nn.Module:
    """``accelerator.prepare(model)`` with a :class:`RematHook` on the underlying module.

    ``budget`` and ``options`` (``seq_bucket``, ``cache_dir``, ``ilp_time_limit_s``,
    ``auto_batch_size``, ``multiple_of``, ``max_val``, ``verbose``, ``compile``) win over ``plugin``, whose unset fields
    come from ``REMAT_*`` variables.  Without a budget from any of them this is exactly
    ``accelerator.prepare(model)``.  Prepare the optimizer as usual, before or after: its state
    still to be created is taken out of the budget when the plan is made.  It returns only the
    model, with auto batch size too: :func:`choose_batch_size` gives the size.
    """
    RematConfig.check_names(options, stage="remat_plugin.accelerate")
    explicit = {k: v for k, v in {"budget": budget, **options}.items() if v is not None}
    # Explicit values go in before the environment is read, so a bad REMAT_* they override is never looked at.
    plugin = dataclasses.replace(plugin, **explicit) if plugin is not None else RematPlugin(**explicit)
    if not plugin.enabled:
        if plugin.verbose is not False:
            announce(f"remat_plugin.accelerate: no budget (budget=... or {_BUDGET_ENV}); training without remat", log)
        if is_rank_zero() and plugin.auto_batch_mode:
            log.warning("remat_plugin.accelerate: auto_batch_size needs a budget (budget=... or %s); "
                        "choose_batch_size will return the script's batch size", _BUDGET_ENV)
        return accelerator.prepare(model)
    config = plugin.to_config()
    _check_supported(accelerator)
    if _sharded(accelerator, model):
        return _prepare_sharded(accelerator, model, config)
    if find_hook(model) is not None:
        raise RematError("remat_plugin.accelerate: the model already has a RematHook (prepare ran on it before); "
                         "call prepare once per model, or first remove the hook with "
                         "accelerate.hooks.remove_hook_from_module")
    if not _avoid_double_checkpointing(model):
        return accelerator.prepare(model)

    refuse_compiled(model, "REMAT_COMPILE=1 (or prepare(..., compile=True))")
    prepared = accelerator.prepare(model)
    target = extract_model_from_parallel(prepared, keep_torch_compile=False)
    hook = RematHook(config, optimizers=lambda: _optimizers_of(accelerator, target),
                     wrap_forward=_mixed_precision_forward(accelerator))
    add_hook_to_module(target, hook, append=True)
    _keep_plans_in_checkpoints(accelerator, target, hook)
    warm_backward_workspaces(accelerator.device)  # cuBLAS's one-time blocks, made before the first step meters
    if config.verbose:
        announce(f"remat_plugin.accelerate: rewriting {type(target).__name__} "
                 f"({sum(p.numel() for p in target.parameters()):,} parameters), budget {config.budget}", log)
    return prepared


# --- FSDP2 --------------------------------------------------------------------------------------------
_FSDP: weakref.WeakKeyDictionary[nn.Module, FsdpRemat] = weakref.WeakKeyDictionary()


def find_fsdp(model: nn.Module) -> FsdpRemat | None:
    """The :class:`~remat_plugin.runtime.fsdp_units.FsdpRemat` :func:`prepare` put on a sharded model, if any."""
    return _FSDP.get(extract_model_from_parallel(model, keep_torch_compile=False))


def _sharded(accelerator: Accelerator, model: nn.Module) -> bool:
    """FSDP2: Accelerate's (``fsdp_version: 2``), or ``fully_shard`` applied by the script before this."""
    return accelerator.is_fsdp2 or bool(leaf_units(extract_model_from_parallel(model, keep_torch_compile=False)))


def _prepare_sharded(accelerator: Accelerator, model: nn.Module, config: RematConfig) -> nn.Module:
    """Plan each ``fully_shard`` unit (NOTE [FSDP2 units]); ``accelerator.prepare(model)`` first unless the
    model is sharded already (``accelerator.prepare(model, optimizer)``, or the script's own ``fully_shard``)."""
    for option, value in (("auto_batch_size", config.auto_batch_size), ("compile", config.compile)):
        if value:
            raise RematError(f"remat_plugin.accelerate: {option}={value!r} is not supported with sharded "
                             "(fully_shard) layers; remove it")
    plugin = accelerator.state.fsdp_plugin if accelerator.is_fsdp2 else None
    if plugin is not None and plugin.activation_checkpointing:
        if is_rank_zero():
            log.warning("remat_plugin.accelerate: the FSDP plugin already checkpoints activations "
                        "(fsdp_activation_checkpointing); remat stays off to avoid checkpointing twice. Turn it off "
                        "to let remat_plugin plan instead.")
        return accelerator.prepare(model)
    target = extract_model_from_parallel(model, keep_torch_compile=False)
    prepared = model if leaf_units(target) else accelerator.prepare(model)
    target = extract_model_from_parallel(prepared, keep_torch_compile=False)
    if not leaf_units(target):
        raise RematError(f"remat_plugin.accelerate: {type(target).__name__} has no fully_shard unit inside it. Shard "
                         "its layers (fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP with "
                         "fsdp_transformer_layer_cls_to_wrap, or fully_shard on each layer), or unset "
                         f"{_BUDGET_ENV}")
    if target in _FSDP:
        raise RematError("remat_plugin.accelerate: the model's sharded layers are planned already (prepare ran on "
                         "it before); call prepare once per model")
    remat = _FSDP[target] = FsdpRemat(target, config.budget, ilp_time_limit_s=config.ilp_time_limit_s)
    if config.verbose:
        announce(f"remat_plugin.accelerate: planning {len(remat.unit_names)} sharded layers of "
                 f"{type(target).__name__}, budget {config.budget} per rank", log)
    return prepared


def _mixed_precision_forward(accelerator: Accelerator) -> Callable[[Callable], Callable] | None:
    """What ``accelerator.prepare`` wraps the forward in under mixed precision (autocast, outputs to fp32).

    The session replaces ``module._old_forward``, which is that wrapped forward: the planned step
    must run inside the same autocast, so its casts are traced and replayed as the unmodified step's.
    """
    if not accelerator.native_amp:
        return None

    def wrap(forward: Callable) -> Callable:
        autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
        return convert_outputs_to_fp32(autocast(forward))

    return wrap


def _check_supported(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise RematError("remat_plugin.accelerate: FSDP1 (fsdp_version: 1) is not supported; set fsdp_version: 2 "
                         "(with fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP) and remat_plugin plans each sharded "
                         f"layer, or unset {_BUDGET_ENV}.")
    if kind in _UNSUPPORTED:
        raise RematError(f"remat_plugin.accelerate: distributed_type {kind.value} is not supported; the plan runs "
                         f"in one process or under DDP (MULTI_GPU, MULTI_CPU, ...). Unset {_BUDGET_ENV} or "
                         "drop budget= to train without remat.")
    if accelerator.mixed_precision not in SUPPORTED_MIXED_PRECISION:
        raise RematError(f"remat_plugin.accelerate: mixed_precision {accelerator.mixed_precision!r} is not supported; "
                         f"use one of {', '.join(SUPPORTED_MIXED_PRECISION)}, or unset {_BUDGET_ENV}.")
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        raise RematError("remat_plugin.accelerate: the Accelerator compiles the model (dynamo_backend "
                         f"{accelerator.state.dynamo_plugin.backend.value}), which would run it without the plan; "
                         "use dynamo_backend='no' and REMAT_COMPILE=1 (or compile=True) to compile the planned step")


def _avoid_double_checkpointing(model: nn.Module) -> bool:
    """Our plan replaces HF gradient checkpointing; ``CheckpointWrapper`` modules, which we cannot undo, turn us off."""
    wrapped = settle_checkpointing(model, "remat_plugin.accelerate", *rank_zero_tellers(log))
    if wrapped:
        if is_rank_zero():
            log.warning("remat_plugin.accelerate: the model already uses CheckpointWrapper modules (%s); remat stays "
                        "off to avoid checkpointing twice. Remove them to let remat_plugin plan instead.",
                        ", ".join(wrapped[:3]))
        return False
    return True


def _optimizers_of(accelerator: Accelerator, module: nn.Module) -> list:
    """The accelerator's prepared optimizers that hold ``module``'s parameters, looked up when a plan is made."""
    params = {id(p) for p in module.parameters()}
    return [opt for opt in accelerator._optimizers
            if any(id(p) in params for group in unwrap(opt).param_groups for p in group["params"])]


def plans_file(index: int) -> str:
    """File name of model ``index``'s plans in a ``save_state`` folder (Accelerate's ``model``/``model_1`` scheme)."""
    return "remat_plans.json" if index == 0 else f"remat_plans_{index}.json"


def _keep_plans_in_checkpoints(accelerator: Accelerator, target: nn.Module, hook: RematHook) -> None:
    """``save_state`` writes the plans next to the weights and ``load_state`` reads them, so a resumed run does
    not solve again.  A separate file, not ``register_for_checkpointing``: checkpoints saved with remat on
    still load with it off, and the other way round."""

    def index_of(models: list[nn.Module]) -> int | None:
        for i, m in enumerate(models):
            if extract_model_from_parallel(m, keep_torch_compile=False) is target:
                return i
        return None

    def save(models: list[nn.Module], weights: list, output_dir: str) -> None:
        index = index_of(models)
        writer = accelerator.is_local_main_process if accelerator.project_configuration.save_on_each_node \
            else accelerator.is_main_process
        if hook.attached and index is not None and writer:
            Path(output_dir, plans_file(index)).write_text(json.dumps(hook.state_dict()))

    def load(models: list[nn.Module], input_dir: str) -> None:
        index = index_of(models)
        path = Path(input_dir, plans_file(index)) if index is not None else None
        if hook.attached and path is not None and path.exists():
            hook.load_state_dict(json.loads(path.read_text()))

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


# --- auto batch size --------------------------------------------------------------------------------
def choose_batch_size(accelerator: Accelerator, model: nn.Module, example_inputs: tuple[tuple, dict],
                      default: int) -> int:
    """The per-process training batch size: ``default``, or the one auto batch size chooses.

    With ``auto_batch_size`` on for ``model`` (``prepare(..., auto_batch_size=True)``, the
    plugin, or ``REMAT_AUTO_BATCH_SIZE``), rank 0 plans the step at candidate sizes from
    ``example_inputs`` and picks the largest whose best plan fits the budget ("max") or the
    fastest per sample ("throughput"), a multiple of ``multiple_of`` and at most ``max_val``;
    then every rank runs one real forward+backward at that size through the hook and the largest
    peak of all ranks decides (one notch smaller if it is over the budget).  That step's plan is
    kept, so the first training step at this size does not plan again.  Every rank returns the
    same size; the :class:`~remat_plugin.batch_size.search.BatchSizeChoice` is kept in
    ``find_hook(model).batch_size_choice`` and its summary logged on the main process.  With auto
    batch size off (or no budget, so no hook), this returns ``default`` and does nothing else.

    Call it on every process at the same point (it runs collectives), after :func:`prepare` and
    after preparing the optimizer (the state it will create is taken out of the budget), before
    training.  A second call returns the first call's size.

    Args:
        example_inputs: ``(args, kwargs)`` of one call of ``model``'s forward at the script's
            batch size, e.g. ``((), {"input_ids": ids, "labels": ids})`` from the first batch;
            tensors are moved to ``accelerator.device``.  Their values are only used to build
            inputs of other sizes (rows repeated or cut).
        default: the script's batch size, returned when auto batch size is off.
    """
    hook = find_hook(model)
    if hook is None or not hook.auto_batch_size:
        return default
    if hook.batch_size_choice is not None:
        return hook.batch_size_choice.batch_size
    if hook.session is None or not hook.attached:
        raise RematError("remat_plugin.accelerate: choose_batch_size: the model's RematHook is detached; call it on "
                         "the model prepare returned, with the hook on")
    args, kwargs = _example_call(example_inputs)
    args, kwargs = send_to_device((args, kwargs), accelerator.device)
    session, target = hook.session, hook.session.module
    with _training_mode(target), torch.enable_grad():
        # The module's arguments after every other hook's pre_forward: what the session will see.
        args, kwargs = session.record_call(lambda: target(*args, **kwargs))
        choice = tune_batch_size(session, args, kwargs)  # the options of the session's config: hook.config
    hook.batch_size_choice = choice
    if hook.config.verbose:
        announce(f"remat_plugin.accelerate: {choice.summary()}", log)
    return choice.batch_size


def _example_call(example_inputs: Any) -> tuple[tuple, dict]:
    if not (isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 2
            and isinstance(example_inputs[0], (tuple, list)) and isinstance(example_inputs[1], dict)):
        raise RematError("remat_plugin.accelerate: choose_batch_size: example_inputs must be (args, kwargs) of one "
                         "call of the model, e.g. ((), {'input_ids': ids, 'labels': ids}); got "
                         f"{type(example_inputs).__name__}")
    return tuple(example_inputs[0]), dict(example_inputs[1])


@contextlib.contextmanager
def _training_mode(module: nn.Module) -> Iterator[None]:
    """The module in training mode inside (the probe needs a training call), each submodule's mode restored after."""
    modes = {} if module.training else {m: m.training for m in module.modules()}
    module.train()
    try:
        yield
    finally:
        for m, mode in modes.items():
            m.training = mode


def rebuild_dataloader(accelerator: Accelerator, dataloader: DataLoader, batch_size: int) -> DataLoader:
    """A new training dataloader over the same dataset with ``batch_size`` per process, prepared by ``accelerator``.

    Pass the unprepared ``DataLoader`` (the usual case: choose the size, then prepare the loader
    this way) or the one ``accelerator.prepare`` returned; then its base loader is rebuilt
    (Accelerate's ``DataLoaderShard``/``DataLoaderDispatcher`` keep it in ``base_dataloader``)
    and the old one is dropped from the accelerator's dataloaders, so ``save_state`` counts only
    the new one.  The sampler is kept (a ``RandomSampler`` still shuffles, with its generator),
    as are ``drop_last``, ``collate_fn``, ``num_workers``, ``pin_memory`` and the other worker
    options.  With ``split_batches`` the loader's batch is ``batch_size * num_processes``, so
    each process still gets ``batch_size``.  A custom ``batch_sampler`` cannot be rebuilt with
    another size: build that loader yourself.
    """
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"remat_plugin.accelerate: rebuild_dataloader: batch_size {batch_size!r} is not a positive "
                         "integer")
    base = getattr(dataloader, "base_dataloader", None)
    source: DataLoader = base if base is not None else dataloader
    dataset = source.dataset
    if isinstance(dataset, IterableDatasetShard):
        dataset = dataset.dataset
    drop_last = bool(getattr(dataloader, "_drop_last", source.drop_last))
    kwargs: dict[str, Any] = {k: getattr(source, k) for k in ("collate_fn", "num_workers", "pin_memory", "timeout",
                                                               "worker_init_fn", "multiprocessing_context",
                                                               "generator", "persistent_workers")}
    if source.num_workers > 0:
        kwargs["prefetch_factor"] = source.prefetch_factor
    if getattr(source, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = source.pin_memory_device
    if not isinstance(dataset, IterableDataset):
        batch_sampler = source.sampler if isinstance(source.sampler, BatchSampler) else source.batch_sampler
        if isinstance(batch_sampler, BatchSamplerShard):
            batch_sampler = batch_sampler.batch_sampler
        if not isinstance(batch_sampler, BatchSampler) or getattr(batch_sampler, "sampler", None) is None:
            raise RematError(f"remat_plugin.accelerate: rebuild_dataloader: the dataloader batches with "
                             f"{type(batch_sampler).__name__}, not a batch_size; build its loader with batch size "
                             f"{batch_size} yourself")
        kwargs["sampler"] = batch_sampler.sampler  # a RandomSampler keeps shuffling, with its own generator
        drop_last = batch_sampler.drop_last
    per_loader = batch_size * accelerator.num_processes if accelerator.split_batches else batch_size
    new = DataLoader(dataset, batch_size=per_loader, drop_last=drop_last, **kwargs)
    if base is not None:  # the prepared loader it replaces
        accelerator._dataloaders[:] = [d for d in accelerator._dataloaders if d is not dataloader]
    return accelerator.prepare(new)
