"""Errors a user can cause; each says which stage, the numbers, and the fix."""
from __future__ import annotations

from typing import Any


def human_bytes(n: float) -> str:
    """``1536`` → ``'1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class RematError(RuntimeError):
    """Base class of remat_plugin's user-facing errors."""


class OptionError(RematError, ValueError):
    """An option value we cannot use, kept as fields so each caller names it its own way.

    An argument, a ``REMAT_*`` variable and a ``remat launch`` flag are the same value said three ways:
    the caller restates the error (:meth:`restated`) or builds its own line from :attr:`detail`, and
    never edits the message text.  ``OptionError("whole message")`` still works where no field fits.

    Fields: ``stage`` (who is reading the option), ``option`` (its name), ``value`` (as given: the
    variable's text when ``variable`` is set), ``reason`` (what is wrong, naming option and value),
    ``accepted`` (what to give instead), ``variable`` (the ``REMAT_*`` variable the value came from,
    or None), ``fix`` (a closing sentence: how to get past it).
    """

    def __init__(self, message: str | None = None, *, option: str | None = None, value: Any = None,
                 reason: str = "", accepted: str | None = None, variable: str | None = None, fix: str | None = None,
                 stage: str = "remat_plugin"):
        self.option, self.value, self.reason, self.accepted = option, value, reason, accepted
        self.variable, self.fix, self.stage = variable, fix, stage
        self._whole = message
        super().__init__(message if message is not None else self._compose())

    @property
    def detail(self) -> str:
        """What is wrong and what to give instead, without the stage, the variable or the fix."""
        if self._whole is not None:
            return self._whole
        give = f"give {self.accepted}" if self.accepted else ""
        return "; ".join(part for part in (self.reason, give) if part)

    def _compose(self) -> str:
        source = f"{self.variable}={self.value!r} is invalid: " if self.variable else ""
        fix = f". {self.fix}" if self.fix else ""
        return f"{self.stage}: {source}{self.detail}{fix}"

    def restated(self, **changes: Any) -> OptionError:
        """The same error (same type) with some fields changed: the variable the value came from, the caller's stage."""
        fields = {"option": self.option, "value": self.value, "reason": self.reason, "accepted": self.accepted,
                  "variable": self.variable, "fix": self.fix, "stage": self.stage, "message": self._whole}
        return type(self)(**{**fields, **changes})


class BudgetFormatError(OptionError):
    """A budget string or number that cannot be read."""


class InfeasibleBudgetError(RematError):
    """No schedule fits the budget; carries the smallest budget that would work."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int, what: str = "forward+backward",
                 advice: str = "Raise the budget to at least that, or reduce the batch size."):
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        super().__init__(
            f"remat_plugin.plan: no schedule of the {what} fits the budget of {budget_bytes} bytes "
            f"({human_bytes(budget_bytes)}); the smallest feasible budget is {min_feasible_bytes} bytes "
            f"({human_bytes(min_feasible_bytes)}). {advice}"
        )


class CallsInFlightError(InfeasibleBudgetError):
    """A call would run beside earlier calls of the module whose backward has not run yet, over the budget
    (NOTE [calls in flight] in remat_plugin.capture.output_usage)."""

    def __init__(self, model: str, calls: int, held_bytes: int, predicted_bytes: int, budget_bytes: int,
                 unplanned_bytes: int):
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = held_bytes + predicted_bytes  # what this call would reach, its plan unchanged
        RematError.__init__(
            self,
            f"remat_plugin: {model} was called while {calls} earlier call(s) of it still await backward(), holding "
            f"{human_bytes(held_bytes)} that the plan of this call does not count: with its predicted peak of "
            f"{human_bytes(predicted_bytes)} the step would reach {human_bytes(held_bytes + predicted_bytes)}, over "
            f"the budget of {human_bytes(budget_bytes)}. A plan holds one call at a time. Call backward() after each "
            "call (the gradients of a sum of losses are the same), pass the inputs as one batch (torch.cat along "
            "the batch dimension) so that one plan covers them, or raise the budget to about "
            f"{human_bytes((calls + 1) * unplanned_bytes)} ({calls + 1} times a call's unmodified peak, with "
            "margin), which holds the calls as they are.")


class CaptureError(RematError):
    """torch.export could not capture the module; names the failing op or line.

    ``fallback``: whether per-layer checkpointing may run the model instead (it may not where checkpointing's
    recomputation would compute something else than the first forward did).
    """

    def __init__(self, message: str, *, fallback: bool = True):
        super().__init__(message)
        self.fallback = fallback
