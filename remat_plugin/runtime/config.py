"""``RematConfig``: every option of the Lightning callback and the Accelerate hook, in one place.

Read from keyword arguments, a dict/YAML mapping (:meth:`RematConfig.from_dict`, unknown keys
rejected by name) or the environment (:meth:`RematConfig.from_env`, variables ``REMAT_*``),
which is how ``REMAT_BUDGET=80% accelerate launch train.py`` reaches a script.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from remat_plugin.errors import BudgetFormatError, RematError
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.signature import BucketPolicy, round_length

ENV_PREFIX = "REMAT_"


class ConfigError(RematError, ValueError):
    """An option that does not exist or has a value we cannot use."""


@dataclass(frozen=True)
class RematConfig:
    # The most one training step may add to allocated memory: bytes, "12GiB", or "80%" of free
    # memory at plan time.  Optimizer state not yet created is taken out of it.
    budget: int | str = "80%"
    # How sequence lengths round up into plan buckets: "pow2", a multiple (64), or None (exact).
    seq_bucket: BucketPolicy = "pow2"
    # Directory where plans are also stored, so a new process with the same model does not re-solve.
    cache_dir: str | None = None
    # Time cap of each block ILP solve, seconds: planning time against plan quality.
    ilp_time_limit_s: float = 0.5

    def __post_init__(self) -> None:
        parse_budget(self.budget)  # raises BudgetFormatError naming the accepted forms
        try:
            round_length(1, self.seq_bucket)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not (isinstance(self.ilp_time_limit_s, (int, float)) and self.ilp_time_limit_s > 0):
            raise ConfigError(f"remat_plugin: ilp_time_limit_s {self.ilp_time_limit_s!r} must be a positive number")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RematConfig:
        """From a mapping (a YAML section); a key that is not an option is an error naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"remat_plugin: unknown option(s) {', '.join(map(repr, unknown))}; "
                              f"the options are {', '.join(sorted(known))}")
        return cls(**dict(values))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RematConfig:
        """Options from ``REMAT_<OPTION>`` variables; keyword arguments that are not None win."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            text = environ.get(ENV_PREFIX + f.name.upper())
            if text is not None:
                values[f.name] = _from_text(f.name, text)
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.from_dict(values)
        except BudgetFormatError as exc:
            if "budget" in overrides and overrides["budget"] is not None:
                raise
            raise BudgetFormatError(f"{ENV_PREFIX}BUDGET={environ.get(ENV_PREFIX + 'BUDGET')!r}: {exc}") from None


def _from_text(name: str, text: str) -> Any:
    if name == "budget":
        return int(text) if text.strip().isdigit() else text
    if name == "seq_bucket":
        low = text.strip().lower()
        return None if low in ("", "none", "exact") else int(low) if low.isdigit() else low
    if name == "ilp_time_limit_s":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"remat_plugin: {ENV_PREFIX}ILP_TIME_LIMIT_S={text!r} is not a number") from None
    return text or None
