"""``RematConfig``: every option of the Lightning callback and the Accelerate hook, in one place.

Read from keyword arguments, a dict/YAML mapping (:meth:`RematConfig.from_dict`, unknown keys
rejected by name) or the environment (:meth:`RematConfig.from_env`, the variables of
:data:`ENV_VARIABLES`), which is how ``REMAT_BUDGET=80% accelerate launch train.py`` reaches a
script.  Every value is checked once, in ``__post_init__``; an error carries its fields
(:class:`~remat_plugin.errors.OptionError`) so each caller names the value its own way.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from remat_plugin.capture.segments import MAX_SEGMENTS
from remat_plugin.errors import OptionError
from remat_plugin.planning.menus import DEFAULT_ILP_TIME_LIMIT_S
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.signature import BucketPolicy, round_length

ENV_PREFIX = "REMAT_"

# Option -> the variable it is read from.  The batch size limits say what they limit, so their names differ.
ENV_VARIABLES = {
    "budget": "REMAT_BUDGET",
    "seq_bucket": "REMAT_SEQ_BUCKET",
    "cache_dir": "REMAT_CACHE_DIR",
    "ilp_time_limit_s": "REMAT_ILP_TIME_LIMIT_S",
    "auto_batch_size": "REMAT_AUTO_BATCH_SIZE",
    "multiple_of": "REMAT_BATCH_MULTIPLE_OF",
    "max_val": "REMAT_MAX_BATCH_SIZE",
    "verbose": "REMAT_VERBOSE",
    "compile": "REMAT_COMPILE",
    "backward_segments": "REMAT_BACKWARD_SEGMENTS",
    "trace_layers_once": "REMAT_TRACE_LAYERS_ONCE",
}
AUTO_BATCH_MODES = ("max", "throughput")

_AUTO_ON = ("1", "true", "yes", "max")
_AUTO_OFF = ("0", "false", "no", "")
_AUTO_TEXTS = ("1, true, yes or max (the largest batch size whose plan fits the budget), throughput (the most "
               "predicted samples per second), or 0, false, no or empty (off)")
_ON = ("1", "true", "yes")
_OFF = ("0", "false", "no")
# What an unset variable gives, where the default alone does not say it.
_UNSET_GIVES = {"auto_batch_size": "off: the script's batch size", "max_val": "no limit"}


class ConfigError(OptionError):
    """An option that does not exist or has a value we cannot use."""


@dataclass(frozen=True)
class RematConfig:
    # The most one training step may add to allocated memory: bytes, "12GiB", or "80%" of free
    # memory at plan time.  Optimizer state not yet created is taken out of it.
    budget: int | str = "80%"
    # How sequence lengths round up into plan buckets: "pow2", a multiple (64), or None / "exact" (no rounding).
    seq_bucket: BucketPolicy = "pow2"
    # Directory where plans are also stored, so a new process with the same model does not re-solve.
    cache_dir: str | None = None
    # Time cap of each block ILP solve, seconds: planning time against plan quality.
    ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S
    # Auto batch size: "max" (or True) trains at the largest batch whose best plan fits the budget, "throughput" at
    # the one with the most predicted samples per second; False keeps the script's batch size.
    auto_batch_size: bool | str = False
    # The chosen batch size is a multiple of this (tensor cores, or a size the data pipeline needs).
    multiple_of: int = 1
    # ... and at most this (what the learning rate or the data allow); None: no limit.
    max_val: int | None = None
    # A progress bar on a terminal and one INFO line per new plan, shown without any logging set-up; False: only
    # warnings (a 15 s first step otherwise looks like a hang).
    verbose: bool = True
    # Run the planned forward and backward as inductor kernels (our schedule decides what is kept; inductor
    # fuses inside it).  The way to have both remat and compiled kernels: a torch.compile'd model is refused.
    compile: bool = False
    # The planned backward hands autograd its gradients in up to this many steps as it goes, so DDP's buckets
    # all-reduce while it still computes (NOTE [segmented backward]); 1: every gradient at the end, in one node.
    backward_segments: int = MAX_SEGMENTS
    # Capture traces one layer of each kind of the model's repeated layers and splices it in at every call, instead
    # of tracing every layer (NOTE [layers traced once]); the plan is the same, planning deep models is faster.
    trace_layers_once: bool = True

    def __post_init__(self) -> None:
        parse_budget(self.budget)  # raises BudgetFormatError naming the accepted forms
        if self.seq_bucket == "exact":
            object.__setattr__(self, "seq_bucket", None)
        try:
            round_length(1, self.seq_bucket)
        except ValueError:
            raise ConfigError(option="seq_bucket", value=self.seq_bucket,
                              reason=f"seq_bucket {self.seq_bucket!r} is not 'pow2', a positive int, 'exact' or None "
                                     "(exact lengths)") from None
        if not (isinstance(self.ilp_time_limit_s, (int, float)) and self.ilp_time_limit_s > 0):
            raise ConfigError(option="ilp_time_limit_s", value=self.ilp_time_limit_s,
                              reason=f"ilp_time_limit_s {self.ilp_time_limit_s!r} must be a positive number")
        if self.auto_batch_size is True:
            object.__setattr__(self, "auto_batch_size", "max")
        if self.auto_batch_size is not False and self.auto_batch_size not in AUTO_BATCH_MODES:
            raise ConfigError(option="auto_batch_size", value=self.auto_batch_size,
                              reason=f"auto_batch_size {self.auto_batch_size!r} is not True, False, 'max' or "
                                     "'throughput'")
        if not _positive_int(self.multiple_of):
            raise ConfigError(option="multiple_of", value=self.multiple_of,
                              reason=f"multiple_of {self.multiple_of!r} ({ENV_VARIABLES['multiple_of']}) must be a "
                                     "positive integer")
        if self.max_val is not None and not (_positive_int(self.max_val) and self.max_val >= self.multiple_of):
            raise ConfigError(option="max_val", value=self.max_val,
                              reason=f"max_val {self.max_val!r} ({ENV_VARIABLES['max_val']}) must be an integer >= "
                                     f"multiple_of ({self.multiple_of})")
        if not isinstance(self.verbose, bool):
            raise ConfigError(option="verbose", value=self.verbose, reason=f"verbose {self.verbose!r} is not True or False")
        if not isinstance(self.compile, bool):
            raise ConfigError(option="compile", value=self.compile, reason=f"compile {self.compile!r} is not True or False")
        if not isinstance(self.trace_layers_once, bool):
            raise ConfigError(option="trace_layers_once", value=self.trace_layers_once,
                              reason=f"trace_layers_once {self.trace_layers_once!r} is not True or False")
        if not _positive_int(self.backward_segments):
            raise ConfigError(option="backward_segments", value=self.backward_segments,
                              reason=f"backward_segments {self.backward_segments!r} "
                                     f"({ENV_VARIABLES['backward_segments']}) must be a positive integer (1: one node)")

    @classmethod
    def check_names(cls, names: Iterable[str], stage: str = "remat_plugin") -> None:
        """Raise :class:`ConfigError` naming each of ``names`` that is not an option, and the options."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(names) - known)
        if unknown:
            shown = ", ".join(map(repr, unknown))
            raise ConfigError(option=", ".join(unknown), stage=stage,
                              reason=f"unknown option(s) {shown}; the options are {', '.join(sorted(known))}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RematConfig:
        """From a mapping (a YAML section); a key that is not an option is an error naming it."""
        cls.check_names(values)
        return cls(**dict(values))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> RematConfig:
        """Options from the variables of :data:`ENV_VARIABLES`; keyword arguments that are not None win.

        The variable of an option given as an argument is not read at all, so a bad one it overrides
        does no harm.  An error about a value read from a variable names the variable, its text and
        what unsetting it gives.
        """
        explicit = {k: v for k, v in overrides.items() if v is not None}
        cls.check_names(explicit)
        texts = {name: text for name, text in env_texts(environ).items() if name not in explicit}
        values = {name: _from_text(name, text) for name, text in texts.items()}
        try:
            return cls(**values, **explicit)
        except OptionError as exc:
            if exc.option in texts:
                raise _read_from_variable(exc, exc.option, texts[exc.option]) from None
            raise


def env_texts(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The text of each option whose variable is set.  A blank variable counts as unset (``REMAT_BUDGET=`` turns the
    Accelerate hook off), except ``REMAT_SEQ_BUCKET``, where blank means exact lengths as "exact" and "none" do."""
    environ = os.environ if environ is None else environ
    texts = {name: environ.get(var) for name, var in ENV_VARIABLES.items()}
    return {name: text for name, text in texts.items() if text is not None and (text.strip() or name == "seq_bucket")}


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def _unset_fix(name: str) -> str:
    default = next(f.default for f in dataclasses.fields(RematConfig) if f.name == name)
    return f"Fix {ENV_VARIABLES[name]}, or unset it for the default ({_UNSET_GIVES.get(name, default)})."


def _read_from_variable(exc: OptionError, name: str, text: str) -> OptionError:
    """``exc`` about the value of option ``name``, said as the text of its variable."""
    return exc.restated(variable=ENV_VARIABLES[name], value=text, fix=_unset_fix(name))


def _from_text(name: str, text: str) -> Any:
    """The value of option ``name`` from its variable's text; the value itself is checked by ``__post_init__``."""
    low = text.strip().lower()
    if name == "budget":
        return int(low) if low.isdigit() else text
    if name == "seq_bucket":
        return None if low in ("", "none", "exact") else int(low) if low.isdigit() else low
    if name == "cache_dir":
        return text
    if name == "ilp_time_limit_s":
        try:
            return float(text)
        except ValueError:
            raise ConfigError(option=name, value=text, variable=ENV_VARIABLES[name], reason="it is not a number",
                              fix=_unset_fix(name)) from None
    if name == "auto_batch_size":
        if low in _AUTO_ON:
            return "max"
        if low in _AUTO_OFF:
            return False
        if low == "throughput":
            return low
        raise ConfigError(option=name, value=text, variable=ENV_VARIABLES[name], accepted=_AUTO_TEXTS,
                          fix=_unset_fix(name))
    if name in ("verbose", "compile", "trace_layers_once"):
        if low in _ON or low in _OFF:
            return low in _ON
        raise ConfigError(option=name, value=text, variable=ENV_VARIABLES[name], accepted="1, true or yes (on), or 0, "
                          "false or no (off)", fix=_unset_fix(name))
    if low.isdigit() and int(low) >= 1:  # multiple_of, max_val, backward_segments
        return int(low)
    raise ConfigError(option=name, value=text, variable=ENV_VARIABLES[name], reason="it must be a positive integer",
                      fix=_unset_fix(name))
