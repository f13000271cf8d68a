"""One model's plans over a training run: buckets, reuse, re-planning, persistence and rank agreement.

The Lightning callback and the Accelerate hook are thin adapters over :class:`RematSession`.
The session puts a dispatcher in place of the target module's forward
(:meth:`RematSession.dispatcher`): training calls with gradients run a planned step, every
other call (eval, ``no_grad``, capture itself) runs the original forward.

For a call with new input shapes, in order:

1. a step already built for exactly these shapes runs;
2. else a known plan whose bucket covers the shapes (:func:`~remat_plugin.runtime.signature.covers`) is
   replayed: the graph is captured for these shapes and the plan's schedule re-checked by the
   simulator at these sizes -- no profiling, no solving;
3. else the bucket (sequence length rounded up) is planned, from the disk cache if it holds
   the plan, and the call's step replays that plan.

Plans are made before the call runs, never in the middle of a step.  With more than one
process, every rank gathers the others' shapes each training call; when all ranks need the
same new plan, rank 0 makes it with the smallest budget of all ranks and broadcasts it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from remat_plugin.errors import CaptureError, InfeasibleBudgetError, RematError, human_bytes
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.config import RematConfig
from remat_plugin.runtime.optimizer_state import pending_state_bytes
from remat_plugin.runtime.progress import PlanningProgress
from remat_plugin.runtime.side_effects import unobserved
from remat_plugin.runtime.signature import bucketed_inputs, covers, key_of, signature, volume
from remat_plugin.runtime.steps import PlanMismatch, Step, device_of, plan_step, replay_step

log = logging.getLogger(__name__)

STATE_VERSION = 1


def model_fingerprint(module: nn.Module) -> str:
    """Class, parameter and buffer names and shapes, and the torch version: what a stored plan assumes.

    Dtypes and devices are left out (Lightning converts precision after ``setup``); the input
    signature carries them, and a replayed plan is checked against the graph anyway.
    """
    desc = [type(module).__qualname__, torch.__version__]
    desc += [f"{n}:{tuple(t.shape)}" for n, t in module.state_dict(keep_vars=True).items()]
    return hashlib.sha1("|".join(desc).encode()).hexdigest()[:16]


class _Recorded(Exception):
    """Stops a probe at the module's call, carrying its arguments."""

    def __init__(self, args: tuple, kwargs: dict):
        super().__init__("recorded")
        self.args, self.kwargs = args, kwargs


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class RematSession:
    """Plans and planned steps of ``module`` under ``config``; see the module docstring."""

    def __init__(self, module: nn.Module, config: RematConfig | None = None, *,
                 optimizers: Callable[[], Iterable] = tuple,
                 on_new_plan: Callable[[Plan], None] | None = None):
        self.module = module
        self.config = config or RematConfig()
        self.optimizers = optimizers
        self.on_new_plan = on_new_plan
        self.plans: dict[str, Plan] = {}  # bucket key -> plan
        self._steps: dict[str, Step] = {}  # exact signature key -> step
        self.n_solved = 0  # plans solved in this process (not replayed, loaded or received)
        self.n_replayed = 0  # steps built from a known plan
        self.plan: Plan | None = None  # the plan of the latest training call
        self._plan_of: dict[str, Plan] = {}  # exact signature key -> the plan its step runs
        self._busy = False
        self._recording = False
        self._warned_ranks = False
        self._fingerprint = model_fingerprint(module)

    # --- the forward ---------------------------------------------------------------------
    def dispatcher(self, real_forward: Callable) -> Callable:
        """The function to put in place of ``module.forward``; it calls ``real_forward`` where no plan applies."""

        def forward(*args, **kwargs):
            if self._busy or not (self.module.training and torch.is_grad_enabled()):
                return real_forward(*args, **kwargs)
            if self._recording:
                raise _Recorded(args, kwargs)
            self._busy = True  # capture and the fallback call the module again: those run the original
            try:
                return self._run(args, kwargs)
            finally:
                self._busy = False

        forward.__wrapped__ = real_forward  # type: ignore[attr-defined]
        return forward

    def _run(self, args: tuple, kwargs: dict):
        sig = signature(self.module, args, kwargs)
        key = key_of(sig)
        step = self._step_for(sig, key, args, kwargs)
        self.plan = self._plan_of.get(key, self.plan)
        try:
            return step(args, kwargs)
        except PlanMismatch as exc:  # raised by a replayed step's first call, before anything ran
            if _world_size() > 1:
                raise RematError(f"remat_plugin.session: the plan agreed between ranks does not apply here: {exc}") \
                    from exc
            log.info("remat_plugin: plan does not replay on %s (%s); planning these shapes", key[:120], exc)
            step = self._solve_exact(sig, key, args, kwargs)
            return step(args, kwargs)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Calls to the module run its original forward (for captures made outside the session)."""
        busy, self._busy = self._busy, True
        try:
            yield
        finally:
            self._busy = busy

    def record_call(self, run: Callable[[], Any]) -> tuple[tuple, dict]:
        """The arguments of the first training call ``run()`` makes to the module; that call does not run."""
        self._recording = True
        try:
            run()
        except _Recorded as call:
            return call.args, call.kwargs
        finally:
            self._recording = False
        raise RematError(f"remat_plugin.session: the probe never called {type(self.module).__name__} in training "
                         "mode with gradients enabled")

    # --- which step ------------------------------------------------------------------------
    def _step_for(self, sig: list, key: str, args: tuple, kwargs: dict) -> Step:
        if _world_size() > 1:
            gathered: list[Any] = [None] * _world_size()
            dist.all_gather_object(gathered, (key, key in self._steps))
            if all(have for _, have in gathered):
                return self._steps[key]
            if len({k for k, _ in gathered}) == 1:
                return self._agreed_step(sig, key, args, kwargs)
            if not self._warned_ranks:
                log.warning("remat_plugin: ranks see different input shapes; each rank plans its own shapes")
                self._warned_ranks = True
        if key not in self._steps:
            self._steps[key] = self._local_step(sig, key, args, kwargs, self.training_budget(args, kwargs))
        return self._steps[key]

    def _local_step(self, sig: list, key: str, args: tuple, kwargs: dict, budget: int) -> Step:
        step = self._replay_known(sig, key, args, kwargs, budget)
        if step is not None:
            return step
        plan, step = self._solve_bucket(sig, key, args, kwargs, budget)
        return step if step is not None else self._replay(plan, key, args, kwargs, budget)

    def _replay_known(self, sig: list, key: str, args: tuple, kwargs: dict, budget: int) -> Step | None:
        """Step 2 of the module docstring: the tightest known plan that covers these shapes."""
        known = [(volume(json.loads(k)), k) for k, p in self.plans.items() if covers(json.loads(k), sig)]
        for _, bucket_key in sorted(known):
            plan = self.plans[bucket_key]
            if plan.fallback or plan.predicted_peak_bytes > budget:
                continue
            return self._replay(plan, key, args, kwargs, budget)
        return None

    def _replay(self, plan: Plan, key: str, args: tuple, kwargs: dict, budget: int) -> Step:
        step, info = replay_step(self.module, args, kwargs, plan, budget, key)
        self.n_replayed += 1
        self.plan = self._plan_of[key] = plan

        def run(a: tuple, k: dict):
            out = step(a, k)
            self.plan = self._plan_of[key] = info.get("plan", plan)  # its predicted peak at these sizes
            return out

        return run

    def _solve_bucket(self, sig: list, key: str, args: tuple, kwargs: dict,
                      budget: int) -> tuple[Plan, Step | None]:
        """Plan the bucket of these inputs; returns the plan, and the step when the bucket is these shapes."""
        b_args, b_kwargs, changed = bucketed_inputs(args, kwargs, self.config.seq_bucket)
        b_key = key_of(signature(self.module, b_args, b_kwargs)) if changed else key
        stored = self._load_from_disk(b_key)
        if stored is not None and stored.predicted_peak_bytes <= budget:
            self._add_plan(b_key, stored, solved=False)
            return stored, None
        if changed:
            try:
                plan, _ = self._solve(b_args, b_kwargs, b_key, budget)
                return plan, None
            except (CaptureError, InfeasibleBudgetError, RuntimeError) as exc:
                log.info("remat_plugin: bucket %s could not be planned (%s); planning the exact shapes", b_key[:120],
                         str(exc).splitlines()[0][:200])
        plan, step = self._solve(args, kwargs, key, budget)
        return plan, step

    def _solve_exact(self, sig: list, key: str, args: tuple, kwargs: dict) -> Step:
        _, step = self._solve(args, kwargs, key, self.training_budget(args, kwargs))
        self._steps[key] = step
        return step

    def _solve(self, args: tuple, kwargs: dict, key: str, budget: int) -> tuple[Plan, Step]:
        """Capture, profile and solve for these inputs now (their forward runs once, unobserved)."""
        with PlanningProgress("planning") as progress:
            step, info = plan_step(self.module, args, kwargs, budget, ilp_time_limit_s=self.config.ilp_time_limit_s,
                                   signature=key, progress=progress, find_floor=False)
            with unobserved(self.module, device_of(args, kwargs, self.module)):
                step(args, kwargs)  # traces and plans; the outputs are dropped
        plan = info["plan"]
        self._plan_of[key] = plan
        self._add_plan(key, plan, solved=True)
        self._save_to_disk(key, plan)
        return plan, step

    def _add_plan(self, key: str, plan: Plan, solved: bool) -> None:
        self.plans[key] = plan
        self.plan = plan
        self.n_solved += solved
        if self.on_new_plan is not None:
            self.on_new_plan(plan)

    # --- several processes -------------------------------------------------------------------
    def _agreed_step(self, sig: list, key: str, args: tuple, kwargs: dict) -> Step:
        """All ranks need a step for the same shapes: rank 0 decides the plan, every rank runs it."""
        budgets: list[Any] = [None] * _world_size()
        dist.all_gather_object(budgets, self.training_budget(args, kwargs))
        budget = min(budgets)
        payload: list[Any] = [None]
        step: Step | None = None
        if dist.get_rank() == 0:
            try:
                known = self._replay_known(sig, key, args, kwargs, budget)
                if known is not None:
                    step, plan = known, self.plan
                else:
                    plan, step = self._solve_bucket(sig, key, args, kwargs, budget)
                assert plan is not None
                payload[0] = ("plan", plan.to_json())
            except RematError as exc:
                payload[0] = ("error", f"{type(exc).__name__}: {exc}")
                dist.broadcast_object_list(payload, src=0)
                raise
        dist.broadcast_object_list(payload, src=0)
        kind, text = payload[0]
        if kind == "error":
            raise RematError(f"remat_plugin.session: rank 0 could not plan: {text}")
        plan = Plan.from_json(text)
        if dist.get_rank() != 0:
            self._add_plan(plan.signature, plan, solved=False)
        if step is None:
            step = self._replay(plan, key, args, kwargs, budget)
        self._steps[key] = step
        return step

    # --- budget --------------------------------------------------------------------------
    def training_budget(self, args: tuple, kwargs: dict) -> int:
        """The step's budget in bytes, less the optimizer state the first ``optimizer.step()`` will create."""
        device = device_of(args, kwargs, self.module)
        total = parse_budget(self.config.budget, device)
        pending = pending_state_bytes(self.optimizers())
        budget = total - pending
        if budget <= 0:
            raise InfeasibleBudgetError(total, total + pending, what="training step (its optimizer state alone)")
        log.info("remat_plugin: budget %s (%s) less %s of optimizer state still to be created: %s for forward+backward",
                 human_bytes(total), self.config.budget, human_bytes(pending), human_bytes(budget))
        return budget

    # --- persistence -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plans as JSON, keyed by bucket: what a checkpoint carries so a resumed run does not re-solve."""
        return {"version": STATE_VERSION, "model": self._fingerprint,
                "plans": {k: p.to_json() for k, p in self.plans.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or state.get("model") != self._fingerprint:
            log.warning("remat_plugin: stored plans are for another model or version; they will be re-made")
            return
        for k, text in state.get("plans", {}).items():
            self.plans.setdefault(k, Plan.from_json(text))

    def _cache_path(self, key: str) -> Path | None:
        if not self.config.cache_dir:
            return None
        name = hashlib.sha1(f"{self._fingerprint}|{key}".encode()).hexdigest()[:24]
        return Path(self.config.cache_dir) / f"plan-{name}.json"

    def _load_from_disk(self, key: str) -> Plan | None:
        path = self._cache_path(key)
        if path is None or not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("model") == self._fingerprint and data.get("key") == key:
                log.info("remat_plugin: plan loaded from %s", path)
                return Plan.from_json(data["plan"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("remat_plugin: ignoring unreadable cached plan %s (%s)", path, exc)
        return None

    def _save_to_disk(self, key: str, plan: Plan) -> None:
        path = self._cache_path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"model": self._fingerprint, "key": key, "plan": plan.to_json()}))
        tmp.replace(path)
