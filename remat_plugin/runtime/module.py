"""Public entry point: ``rematerialize(module, args, kwargs, budget)`` → a module that fits the budget."""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

import torch
from torch import nn

from remat_plugin.capture.segments import MAX_SEGMENTS
from remat_plugin.errors import CaptureError, RematError
from remat_plugin.ir.plan import Plan
from remat_plugin.ir.problem import Problem
from remat_plugin.planning.menus import DEFAULT_ILP_TIME_LIMIT_S
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.compiled_models import refuse_compiled
from remat_plugin.runtime.hf_cache import cache_off, say_packing_honoured
from remat_plugin.runtime.reporting import announce
from remat_plugin.runtime.resolver import StepResolver
from remat_plugin.runtime.side_effects import unobserved
from remat_plugin.runtime.signature import Call, device_of
from remat_plugin.runtime.steps import PROCESS_CACHES, PlannedStep, PlanningCaches, written_inputs
from remat_plugin.runtime.store import PlanStore
from remat_plugin.runtime.unplanned_calls import is_planned_call, run_unplanned
from remat_plugin.torch_private import suspended_user_modes

log = logging.getLogger(__name__)


class RematModule(nn.Module):
    """Runs ``original`` under a plan per input signature; eval and no-grad calls run ``original`` itself.

    ``original`` is not registered as a child: parameters, buffers and ``state_dict``
    keys are exactly the original's, and the Parameter objects are the same objects.
    Attributes this module lacks are read from ``original`` (``rm.config``, ``rm.lm_head``,
    ``rm.generate(...)``), as ``torch.compile``'s wrapper does; a method read that way runs the
    original's own forward, unplanned (generation runs without gradients, so nothing is saved).
    Steps are resolved as in a training session (:mod:`remat_plugin.runtime.resolver`) with
    exact shapes: a call with new shapes replays a known plan that covers them, else plans
    them inside that call.  With ``verbose`` (default) planning shows a progress bar on a
    terminal and logs one line per new plan (:mod:`remat_plugin.runtime.reporting`); False: warnings only.
    """

    original: nn.Module  # set with object.__setattr__: not a registered child
    _resolver: StepResolver  # likewise, so nn.Module does not look into it

    def __init__(self, original: nn.Module, budget: int | str, ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S, *,
                 caches: PlanningCaches | None = None, verbose: bool = True, compile: bool = False,
                 backward_segments: int = MAX_SEGMENTS, trace_layers_once: bool = True):
        refuse_compiled(original, "rematerialize(module, ..., compile=True)")
        super().__init__()
        object.__setattr__(self, "original", original)
        self.budget = budget
        self.ilp_time_limit_s = ilp_time_limit_s
        object.__setattr__(self, "_resolver", StepResolver(
            original, PlanStore(original), caches or PROCESS_CACHES, ilp_time_limit_s=ilp_time_limit_s,
            find_floor=True, plan_lazily=True, verbose=verbose, compile=compile, backward_segments=backward_segments,
            trace_layers_once=trace_layers_once))
        self.training = original.training
        self._told_cache_off = False
        self._options = {"verbose": verbose, "compile": compile, "backward_segments": backward_segments,
                         "trace_layers_once": trace_layers_once}
        self.forward = _with_signature_of(  # type: ignore[method-assign]
            original.forward, functools.partial(RematModule.forward, self))

    def __reduce_ex__(self, protocol):
        """A copy or an unpickled module is the original's copy under the same budget and options, planned again
        at its first training call: the plans' programs hold this original's parameters (copying them whole
        copied torch's tracing state and corrupted the heap at exit)."""
        return _remade, (self.original, self.budget, self.ilp_time_limit_s, self._options, self.training)

    # --- the original's state, unchanged -------------------------------------------------
    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)  # our own parameters, buffers and modules (none but the original's)
        except AttributeError:
            original = self.__dict__.get("original")
            if original is None:
                raise
        return getattr(original, name)

    def state_dict(self, *args, **kwargs):
        return self.original.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.original.load_state_dict(*args, **kwargs)

    def named_parameters(self, *args, **kwargs):
        return self.original.named_parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        return self.original.named_buffers(*args, **kwargs)

    def named_children(self):
        return self.original.named_children()

    def named_modules(self, *args, **kwargs):
        return self.original.named_modules(*args, **kwargs)

    def train(self, mode: bool = True):
        self.original.train(mode)
        self.training = mode
        return self

    def _apply(self, fn, recurse=True):
        self.original._apply(fn, recurse)
        self._resolver.clear()  # plans are per device and dtype
        return self

    # --- planning and running ------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # dynamo is tracing this call (torch.compile(rm))
            _refuse_dynamo()
        if not is_planned_call(self.original):
            return run_unplanned(self.original, self.original, args, kwargs)
        with self._planned_call(args, kwargs) as (call, budget):
            return self._resolver.run(call, self._resolver.step_for(call, budget), budget)

    def prepare(self, args: tuple, kwargs: dict) -> Plan:
        """Plan for these inputs now (capture, profile, solve) without changing any state."""
        with self._planned_call(args, kwargs) as (call, budget):
            step = self._resolver.step_for(call, budget)
            if not step.checked:
                written = written_inputs(step.run, call.args, call.kwargs)
                with suspended_user_modes(), unobserved(self.original, call.device, written), step.planning_only():
                    self._resolver.run(call, step, budget)
        self._resolver.latest = self._resolver.steps[call.key]
        plan = self._resolver.latest.plan
        if plan is None:  # the trace found no gradient to take: an inference graph, nothing to plan
            raise CaptureError(
                f"remat_plugin: {type(self.original).__name__} called with these inputs returns no tensor that "
                "requires grad, so its step has no backward to plan. Is it in training mode with trainable "
                "parameters? A reentrant torch.utils.checkpoint (use_reentrant=True) whose inputs do not require "
                "grad gives its parameters no gradient: make an input require grad, or use use_reentrant=False")
        return plan

    @contextlib.contextmanager
    def _planned_call(self, args: tuple, kwargs: dict) -> Iterator[tuple[Call, Callable[[], int]]]:
        """Inside, the original runs without its key/value cache (NOTE [training without the cache]); yields the
        call's signature and its budget."""
        with cache_off(self.original, kwargs) as turned_off:
            if turned_off and not self._told_cache_off and self._resolver.verbose:
                announce(f"remat_plugin: {', '.join(turned_off)} runs its planned training calls with use_cache=False "
                         "(a training step has no use for the key/value cache, which cannot be captured; the config "
                         "is set back after each call)")
            self._told_cache_off = self._told_cache_off or bool(turned_off)
            say_packing_honoured(self.original, kwargs, bool(turned_off))  # NOTE [packed sequences without the cache]
            call = Call.of(self.original, args, kwargs)
            yield call, functools.partial(self._budget_bytes, call)

    def _budget_bytes(self, call: Call) -> int:
        return parse_budget(self.budget, call.device)

    @property
    def plan(self) -> Plan | None:
        """The plan of the latest input signature run or prepared (None before the first)."""
        return self._resolver.current_plan

    @property
    def problem(self) -> Problem | None:
        """The problem the latest signature's plan was solved on (None for a replayed plan or a fallback)."""
        latest = self._resolver.latest
        return latest.problem if latest is not None else None

    @property
    def steps(self) -> Mapping[str, PlannedStep]:
        """The planned steps by input signature key (read-only)."""
        return MappingProxyType(self._resolver.steps)


def _with_signature_of(original: Callable, forward: functools.partial) -> functools.partial:
    """``forward`` reporting ``original``'s signature to ``inspect.signature``: tools read it to decide what to pass
    (transformers' ``Trainer`` keeps only the dataset columns the model's forward names, and passes
    ``num_items_in_batch`` only to a forward that takes ``**kwargs``)."""
    try:
        forward.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a builtin without one: ours, (*args, **kwargs), stands
        pass
    return forward


@torch.compiler.disable
def _refuse_dynamo() -> None:
    """Raised from outside dynamo (it cannot inline a disabled function), so the caller sees this error; a raise in
    the traced frame itself was a graph break, and dynamo went on to compile our capture code and failed deep in it."""
    raise RematError("remat_plugin: torch.compile(rm) cannot trace a planned step (its programs are built and run "
                     "outside dynamo); compile the planned step with rematerialize(model, ..., compile=True) instead")


def _remade(original: nn.Module, budget: int | str, ilp_time_limit_s: float, options: dict,
            training: bool) -> RematModule:
    rm = RematModule(original, budget, ilp_time_limit_s, **options)
    rm.training = training
    return rm


def _check_example_inputs(args: object, kwargs: object) -> None:
    """A tensor or a batch dict passed where the tuple of positional inputs goes used to fail deep inside (a
    tensor's truth value) or be unpacked into its rows or keys: said here, with the call to write instead."""
    if isinstance(args, Mapping):
        raise TypeError(f"rematerialize: args is a {type(args).__name__}; pass keyword inputs (a batch dict) as "
                        "kwargs: rematerialize(model, kwargs=batch, budget=...)")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"rematerialize: args is a {type(args).__name__}, not a tuple of the forward's positional "
                        "inputs; for one input write rematerialize(model, (x,), budget=...)")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"rematerialize: kwargs is a {type(kwargs).__name__}, not a dict of the forward's keyword "
                        "inputs; positional inputs go in one tuple: rematerialize(model, (x, y), budget=...)")


def rematerialize(
    module: nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    budget: int | str = "80%",
    *,
    ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S,
    verbose: bool = True,
    compile: bool = False,
    backward_segments: int = MAX_SEGMENTS,
    trace_layers_once: bool = True,
) -> RematModule:
    """Plan ``module`` for these example inputs under ``budget`` and return the rewritten module.

    Without example inputs (``rematerialize(model, budget="80%")``) nothing is planned yet: each input signature is
    planned by its first training call, inside that call.

    ``budget`` is bytes, a size (``"300MiB"``) or a share of free device memory (``"80%"``):
    the most allocated memory may rise during one forward+backward above what is
    allocated at step start.  Raises :class:`~remat_plugin.errors.InfeasibleBudgetError`
    with the smallest feasible budget when nothing fits.  Planning shows a progress bar on a
    terminal and logs one summary line, on stderr when logging is not configured;
    ``verbose=False`` keeps it quiet (warnings still show).  ``compile=True`` runs the planned
    programs as inductor kernels (NOTE [compiled programs] in :mod:`remat_plugin.capture.compiled_programs`);
    a module already wrapped in ``torch.compile`` is refused: pass the module itself with ``compile=True``.
    ``backward_segments``: the planned backward hands autograd its gradients in up to this many steps
    (DDP's buckets all-reduce meanwhile; NOTE [segmented backward]); 1 keeps it one autograd node.
    ``trace_layers_once``: capture traces one layer of each kind of the model's repeated layers and splices it
    in at every call (NOTE [layers traced once] in :mod:`remat_plugin.capture.repeated_layers`); False traces
    every layer (the same plan, planned more slowly).
    """
    _check_example_inputs(args, kwargs)
    rm = RematModule(module, budget, ilp_time_limit_s, verbose=verbose, compile=compile,
                     backward_segments=backward_segments, trace_layers_once=trace_layers_once)
    if args or kwargs:
        rm.prepare(tuple(args), dict(kwargs or {}))
    else:
        parse_budget(budget, device_of((), {}, module))  # a malformed budget is said now, not at the first step
    return rm
