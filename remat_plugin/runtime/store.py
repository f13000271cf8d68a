"""Plans kept by bucket: what a checkpoint carries, and an optional plan cache on disk.

A stored plan is only valid for the model it was made for: :func:`model_fingerprint` (class,
parameter and buffer names and shapes, torch version) guards both the ``state_dict`` and
the cache files.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat_plugin.ir.plan import Plan
from remat_plugin.runtime.signature import Signature

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


class PlanStore:
    """Plans of one model by bucket signature key; ``cache_dir`` also keeps them on disk."""

    def __init__(self, module: nn.Module, cache_dir: str | None = None):
        self.fingerprint = model_fingerprint(module)
        self.cache_dir = cache_dir
        self.plans: dict[str, Plan] = {}  # bucket signature key -> plan

    def add(self, key: str, plan: Plan) -> None:
        self.plans[key] = plan

    def covering(self, signature: Signature, budget_bytes: int) -> list[Plan]:
        """Known plans that serve ``signature`` within ``budget_bytes``, tightest bucket first: graph plans, and
        fallbacks once metered (NOTE [metered fallback]: a shorter call needs no more than its bucket measured)."""
        found = []
        for key, plan in self.plans.items():
            bucket = Signature.from_key(key)
            if bucket.covers(signature) and 0 <= plan.predicted_peak_bytes <= budget_bytes:
                found.append((bucket.volume, key, plan))
        return [plan for _, _, plan in sorted(found, key=lambda f: (f[0], f[1]))]

    # --- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plans as JSON, keyed by bucket: what a checkpoint carries so a resumed run does not re-solve."""
        return {"version": STATE_VERSION, "model": self.fingerprint,
                "plans": {k: p.to_json() for k, p in self.plans.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION or state.get("model") != self.fingerprint:
            log.warning("remat_plugin: stored plans are for another model or version; they will be re-made")
            return
        for k, text in state.get("plans", {}).items():
            self.plans.setdefault(k, Plan.from_json(text))

    # --- the disk cache --------------------------------------------------------------------
    def _path(self, key: str) -> Path | None:
        if not self.cache_dir:
            return None
        name = hashlib.sha1(f"{self.fingerprint}|{key}".encode()).hexdigest()[:24]
        return Path(self.cache_dir) / f"plan-{name}.json"

    def load_from_disk(self, key: str) -> Plan | None:
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
            if data.get("model") == self.fingerprint and data.get("key") == key:
                log.info("remat_plugin: plan loaded from %s", path)
                return Plan.from_json(data["plan"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("remat_plugin: ignoring unreadable cached plan %s (%s)", path, exc)
        return None

    def save_to_disk(self, key: str, plan: Plan) -> None:
        path = self._path(key)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"model": self.fingerprint, "key": key, "plan": plan.to_json()}))
        tmp.replace(path)
