"""Accelerate: ``model = prepare(accelerator, model, budget="80%")``, or ``REMAT_BUDGET=80% accelerate launch``.

:func:`prepare` runs ``accelerator.prepare(model)`` and attaches a :class:`RematHook` to the
underlying module with ``add_hook_to_module(..., append=True)``, so it composes with Accelerate's
own hooks.  The hook is thin: ``add_hook_to_module`` keeps the real forward in
``module._old_forward`` before it calls ``init_hook``, and calls ``_old_forward`` after every
hook's ``pre_forward``; ``init_hook`` puts a :class:`~remat_plugin.session.RematSession`
dispatcher there and ``detach_hook`` puts the real forward back.  The session plans on the first
training call (the real batch, after the other hooks moved it), re-plans per shape bucket, and
with several processes rank 0 plans and every rank runs the same plan.  No module is replaced,
so ``state_dict`` keys, ``Parameter`` objects and ``save_state`` checkpoints are those of the run
without the hook; the plans travel next to them as ``remat_plans.json``.

The hook goes on after ``accelerator.prepare``, so it wraps whatever forward Accelerate put in
place and removing it gives exactly that back.  Planning captures the module with
``torch.export``, which calls it once more through all its hooks: another hook's
``pre_forward``/``post_forward`` runs one extra time per new plan, on fake tensors.

Options come from arguments, a :class:`RematPlugin`, or the environment (``REMAT_BUDGET``,
``REMAT_SEQ_BUCKET``, ``REMAT_CACHE_DIR``, ``REMAT_ILP_TIME_LIMIT_S``), in that order.  With no
budget anywhere, :func:`prepare` is plain ``accelerator.prepare(model)``.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from accelerate import Accelerator
from accelerate.hooks import ModelHook, SequentialHook, add_hook_to_module
from accelerate.utils import DistributedType, DynamoBackend, extract_model_from_parallel
from torch import nn

from remat_plugin.buckets import describe
from remat_plugin.config import ENV_PREFIX, ConfigError, RematConfig
from remat_plugin.errors import RematError
from remat_plugin.optimizer_state import unwrap
from remat_plugin.plan import Plan
from remat_plugin.session import RematSession

from ._forward_swap import disable_hf_cache, disable_hf_checkpointing, find_double_checkpointing

log = logging.getLogger(__name__)

# Accelerate set-ups whose module we cannot (yet) rewrite: they shard or compile the model themselves.
_UNSUPPORTED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


def _rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


@dataclass
class RematPlugin:
    """Remat options for :func:`prepare`; a field left ``None`` is read from ``REMAT_<FIELD>``.

    Like Accelerate's own plugins, it reads the environment in ``__post_init__``, so the launch
    flag (``REMAT_BUDGET=80% accelerate launch``) reaches a script that never names a budget.
    A budget that is still ``None`` leaves the plugin off.
    """

    # The most one training step may add to allocated memory: bytes, "12GiB", or "80%" of free memory. None: off.
    budget: int | str | None = None
    # How sequence lengths round up into plan buckets: "pow2", a multiple (64), or "exact" (no rounding).
    seq_bucket: int | str | None = None
    # Directory where plans are also kept, so a new run of the same model does not solve again.
    cache_dir: str | None = None
    # Time cap of each block ILP solve, seconds: planning time against plan quality.
    ilp_time_limit_s: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is None:
                setattr(self, f.name, _from_env(f.name))
        self._config()  # a bad explicit value fails here, at construction, not at the first batch

    @property
    def enabled(self) -> bool:
        return self.budget is not None

    def to_config(self) -> RematConfig:
        """The session's options; needs a budget (an argument, this plugin's field, or ``REMAT_BUDGET``)."""
        if self.budget is None:
            raise ConfigError(f"remat_plugin.accelerate: no budget: pass budget=... or set {ENV_PREFIX}BUDGET")
        return self._config()

    def _config(self) -> RematConfig:
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}
        if values.get("seq_bucket") == "exact":
            values["seq_bucket"] = None
        return RematConfig.from_dict(values)


def _from_env(name: str) -> Any:
    """The option ``name`` from ``REMAT_<NAME>``, read as ``RematConfig.from_env`` reads it; errors name the variable."""
    var = ENV_PREFIX + name.upper()
    text = os.environ.get(var)
    if text is None or not text.strip():
        return None
    try:
        value = getattr(RematConfig.from_env({var: text}), name)
    except RematError as exc:
        detail = str(exc).replace("remat_plugin: ", "").replace(f"{var}={text!r}: ", "")
        unset = "to train without remat" if name == "budget" else "for the default"
        raise type(exc)(f"remat_plugin.accelerate: {var}={text!r} is invalid: {detail}. Fix {var}, or unset it "
                        f"{unset}.") from None
    return "exact" if name == "seq_bucket" and value is None else value


class RematHook(ModelHook):
    """Planned rematerialization of the module it is attached to; see the module docstring.

    Attach with ``add_hook_to_module(module, hook, append=True)``; ``remove_hook_from_module``
    restores the original forward.  ``pre_forward``/``post_forward`` pass through: the session sits
    in ``module._old_forward``, where it sees the arguments after every hook's ``pre_forward``.

    Args:
        config: budget and planning options.
        optimizers: returns the optimizers of the module's parameters, called when a plan is
            made: state they have not created yet is taken out of the budget.
    """

    def __init__(self, config: RematConfig | None = None, *, optimizers: Callable[[], Iterable] = tuple):
        self.config = config or RematConfig()
        self.optimizers = optimizers
        self.session: RematSession | None = None
        self._real_forward: Callable | None = None
        self._dispatch: Callable | None = None
        self._stored_state: dict[str, Any] | None = None

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
        self._dispatch = self.session.dispatcher(real)
        module._old_forward = self._dispatch  # type: ignore[assignment]
        return module

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
        if _rank_zero():
            log.info("remat_plugin.accelerate: new plan for inputs %s\n%s", describe(plan.signature), plan.table())

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

    ``budget`` and ``options`` (``seq_bucket``, ``cache_dir``, ``ilp_time_limit_s``) win over
    ``plugin``, whose unset fields come from ``REMAT_*`` variables.  Without a budget from any of
    them this is exactly ``accelerator.prepare(model)``.  Prepare the optimizer as usual, before
    or after: its state still to be created is taken out of the budget when the plan is made.
    """
    known = {f.name for f in dataclasses.fields(RematPlugin)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"remat_plugin.accelerate: unknown option(s) {', '.join(map(repr, unknown))}; "
                          f"the options are {', '.join(sorted(known))}")
    explicit = {k: v for k, v in {"budget": budget, **options}.items() if v is not None}
    # Explicit values go in before the environment is read, so a bad REMAT_* they override is never looked at.
    plugin = dataclasses.replace(plugin, **explicit) if plugin is not None else RematPlugin(**explicit)
    if not plugin.enabled:
        if _rank_zero():
            log.info("remat_plugin.accelerate: no budget (budget=... or %sBUDGET); training without remat", ENV_PREFIX)
        return accelerator.prepare(model)
    config = plugin.to_config()
    _check_supported(accelerator)
    if find_hook(model) is not None:
        raise RematError("remat_plugin.accelerate: the model already has a RematHook (prepare ran on it before); "
                         "call prepare once per model, or first remove the hook with "
                         "accelerate.hooks.remove_hook_from_module")
    if not _avoid_double_checkpointing(model):
        return accelerator.prepare(model)

    prepared = accelerator.prepare(model)
    target = extract_model_from_parallel(prepared, keep_torch_compile=False)
    hook = RematHook(config, optimizers=lambda: _optimizers_of(accelerator, target))
    add_hook_to_module(target, hook, append=True)
    _keep_plans_in_checkpoints(accelerator, target, hook)
    if _rank_zero():
        log.info("remat_plugin.accelerate: rewriting %s (%s parameters), budget %s", type(target).__name__,
                 f"{sum(p.numel() for p in target.parameters()):,}", config.budget)
    return prepared


def _check_supported(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind in _UNSUPPORTED:
        raise RematError(f"remat_plugin.accelerate: distributed_type {kind.value} is not supported; the plan runs "
                         f"in one process or under DDP (MULTI_GPU, MULTI_CPU, ...). Unset {ENV_PREFIX}BUDGET or "
                         "drop budget= to train without remat.")
    if accelerator.mixed_precision != "no":
        raise RematError(f"remat_plugin.accelerate: mixed_precision {accelerator.mixed_precision!r} is not supported "
                         "yet: under autocast the planned step's gradients are not bit-equal to those of the "
                         f"unmodified model. Use mixed_precision='no', or unset {ENV_PREFIX}BUDGET.")
    if accelerator.state.dynamo_plugin.backend != DynamoBackend.NO:
        raise RematError("remat_plugin.accelerate: the Accelerator compiles the model (dynamo_backend "
                         f"{accelerator.state.dynamo_plugin.backend.value}); remat_plugin runs its own planned "
                         f"programs. Use dynamo_backend='no', or unset {ENV_PREFIX}BUDGET.")


def _avoid_double_checkpointing(model: nn.Module) -> bool:
    """Our plan replaces HF gradient checkpointing; ``CheckpointWrapper`` modules, which we cannot undo, turn us off."""
    for name in disable_hf_cache(model):
        if _rank_zero():
            log.info("remat_plugin.accelerate: setting use_cache=False on %s (a cache returned by a training forward "
                     "keeps every layer's keys and values alive; transformers does the same under checkpointing)", name)
    hf, wrapped = find_double_checkpointing(model)
    for m in hf:
        if _rank_zero():
            log.warning("remat_plugin.accelerate: turning off gradient checkpointing of %s; the remat plan decides "
                        "what to recompute (gradients are unchanged)", type(m).__name__)
        disable_hf_checkpointing(m)
    if wrapped:
        if _rank_zero():
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
