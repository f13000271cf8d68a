"""What planning tells the user without being asked: one line per new plan, shown with no logging set up.

:func:`summary_line` says what a plan decided; :func:`announce` logs a line at INFO on rank 0 so
that it shows in a plain script too.  The Lightning callback sends the same line through
Lightning's own logger instead.

NOTE [default output]
Python shows nothing below WARNING until someone configures ``logging``, so a 15 s plan used to
look like a hang.  Like Lightning does for its own logger, when neither the root logger nor
``remat_plugin`` has a handler, :func:`show_by_default` puts a stderr handler on ``remat_plugin``
(``propagate`` off while it is there) and, if that logger's level is unset, sets it to INFO.  The
handler passes warnings and announced lines only; the other INFO lines (stages, solver details)
stay for people who configure logging themselves.  Once they do -- a handler on the root logger
or on ``remat_plugin``, found at the next announcement -- ours comes off and theirs decide.  A
level set on ``remat_plugin`` (``setLevel(logging.WARNING)``) is theirs too and is kept.
"""
from __future__ import annotations

import logging
import sys
from typing import TextIO

from remat_plugin.errors import human_bytes
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime import dist
from remat_plugin.runtime.signature import describe

log = logging.getLogger(__name__)

PACKAGE_LOGGER = "remat_plugin"
_ANNOUNCED = "remat_announced"  # the attribute announce() puts on its log records


def summary_line(plan: Plan, model: str, *, elapsed_s: float = 0.0, loaded_from: str | None = None) -> str:
    """One line for a new plan of ``model``: solved in ``elapsed_s``, or loaded from the cache ``loaded_from``."""
    inputs = describe(plan.signature)
    if plan.fallback:  # "<why capture failed>; per-layer checkpointing of ...": the why is already a warning
        instead = plan.fallback.rpartition("; ")[2]
        return (f"remat_plugin: {model} on {inputs} could not be captured (see the warning): {instead}; a metered "
                f"step chooses how many are checkpointed under the {human_bytes(plan.budget_bytes)} budget")
    how = f"loaded the plan of {model} for {inputs} from {loaded_from}" if loaded_from is not None \
        else f"planned {model} for {inputs} in {elapsed_s:.1f} s"
    fits = f"predicted peak {human_bytes(plan.predicted_peak_bytes)} under a {human_bytes(plan.budget_bytes)} budget"
    recomputed = sum(b.mode != "keep" for b in plan.blocks)
    if recomputed == 0:
        return f"remat_plugin: {how}: the unmodified step fits ({fits}); nothing is recomputed{_loss_only(plan)}"
    return (f"remat_plugin: {how}: {fits} ({plan.predicted_peak_bytes / plan.baseline_peak_bytes:.2f} of the "
            f"unmodified {human_bytes(plan.baseline_peak_bytes)}), {plan.predicted_overhead:.2f}x the unmodified "
            f"step time, {recomputed} of {len(plan.blocks)} blocks recomputed{_loss_only(plan)}")


def _loss_only(plan: Plan) -> str:
    """What a first plan that stepped down to the loss allows (NOTE [loss-only first plan]), or nothing."""
    floors = plan.loss_only_floors
    if not floors:
        return ""
    others = sorted({*plan.dropped_outputs, *plan.ungraded_outputs})
    graded = f"a step that differentiates them needs {human_bytes(floors[0])}"
    if plan.refuses_holding:
        return (f"; only the loss fits: output(s) {others} are freed after the forward (a step that holds them "
                f"through backward() needs {human_bytes(floors[1])}, {graded})")
    if plan.dropped_outputs:  # NOTE [refined step-down]
        return f"; only the loss fits with a gradient: output(s) {others} are freed after the forward ({graded})"
    return f"; only the loss fits with a gradient: output(s) {others} get none ({graded})"


def announce(message: str, logger: logging.Logger = log) -> None:
    """Log ``message`` at INFO on rank 0, on stderr when nobody configured logging (NOTE [default output])."""
    if dist.is_rank_zero():
        show_by_default()
        logger.info("%s", message, extra={_ANNOUNCED: True})


class _DefaultHandler(logging.StreamHandler):
    """stderr as it is at each record (pytest, notebooks and rich's live display swap it); warnings and
    announced lines only."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # not StreamHandler's: it would bind today's sys.stderr
        self.set_package_level = False  # whether we set remat_plugin's level, so we unset it on removal

    @property
    def stream(self) -> TextIO:  # type: ignore[override]
        return sys.stderr

    def filter(self, record: logging.LogRecord) -> bool:  # type: ignore[override]
        shown = record.levelno >= logging.WARNING or getattr(record, _ANNOUNCED, False)
        return bool(shown and super().filter(record))


def show_by_default() -> None:
    """Attach our stderr handler while nobody has configured logging; take it off once somebody has."""
    package = logging.getLogger(PACKAGE_LOGGER)
    ours = next((h for h in package.handlers if isinstance(h, _DefaultHandler)), None)
    configured = bool(logging.getLogger().handlers) or any(h is not ours for h in package.handlers)
    if ours is None and not configured:
        ours = _DefaultHandler()
        package.addHandler(ours)
        package.propagate = False
        if package.level == logging.NOTSET:
            package.setLevel(logging.INFO)
            ours.set_package_level = True
    elif ours is not None and configured:
        package.removeHandler(ours)
        package.propagate = True
        if ours.set_package_level and package.level == logging.INFO:
            package.setLevel(logging.NOTSET)
