"""One model's plans over a training run, for the Lightning callback and the Accelerate hook.

:class:`RematSession` puts a dispatcher in place of the target module's forward
(:meth:`RematSession.dispatcher`): training calls with gradients run a planned step, every
other call (eval, ``no_grad``, capture itself) runs the original forward.  It composes the
runtime's parts:

- :class:`~remat_plugin.runtime.dispatch.Dispatcher`: which calls are planned;
- :class:`~remat_plugin.runtime.resolver.StepResolver`: exact step, replayed plan or new plan,
  per shape bucket (``config.seq_bucket``), made before the call runs;
- :class:`~remat_plugin.runtime.store.PlanStore`: plans by bucket, in checkpoints and on disk;
- :class:`~remat_plugin.runtime.agreement.RankAgreement`: with several processes, rank 0 plans
  with the smallest budget of all ranks and every rank runs that plan;

and owns the budget: the configured budget less the optimizer state still to be created.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from torch import nn

from remat_plugin.errors import InfeasibleBudgetError, human_bytes
from remat_plugin.ir.plan import Plan
from remat_plugin.runtime import dist
from remat_plugin.runtime.agreement import RankAgreement
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.config import RematConfig
from remat_plugin.runtime.dispatch import Dispatcher
from remat_plugin.runtime.hf_cache import say_packing_honoured
from remat_plugin.runtime.optimizer_state import pending_state_bytes
from remat_plugin.runtime.reporting import announce
from remat_plugin.runtime.resolver import StepResolver
from remat_plugin.runtime.signature import Call, device_of
from remat_plugin.runtime.steps import PROCESS_CACHES, PlanningCaches
from remat_plugin.runtime.store import PlanStore

log = logging.getLogger(__name__)


class RematSession:
    """Plans and planned steps of ``module`` under ``config``; see the module docstring.

    Args:
        optimizers: returns the optimizers of the module's parameters, called when a budget is
            needed: state they have not created yet is taken out of it.
        on_new_plan: told of every new plan (solved, loaded from disk or received from rank 0).
        report: where the one-line summary of each plan solved or loaded here goes, with ``config.verbose``
            (default: the ``remat_plugin`` logger on rank 0, shown without logging set up).
        caches: op timings and prepared planners (default: the process's).
    """

    def __init__(self, module: nn.Module, config: RematConfig | None = None, *,
                 optimizers: Callable[[], Iterable] = tuple, on_new_plan: Callable[[Plan], None] | None = None,
                 caches: PlanningCaches | None = None, report: Callable[[str], None] = announce):
        self.module = module
        self.config = config or RematConfig()
        self.optimizers = optimizers
        self.store = PlanStore(module, self.config.cache_dir)
        self.resolver = StepResolver(module, self.store, caches or PROCESS_CACHES,
                                     ilp_time_limit_s=self.config.ilp_time_limit_s, seq_bucket=self.config.seq_bucket,
                                     verbose=self.config.verbose, report=report, on_new_plan=on_new_plan,
                                     compile=self.config.compile, backward_segments=self.config.backward_segments,
                                     trace_layers_once=self.config.trace_layers_once)
        self.agreement = RankAgreement(self.resolver)
        self._dispatch = Dispatcher(module, self._run)

    # --- what the adapters and tests read ----------------------------------------------------
    @property
    def plans(self) -> dict[str, Plan]:
        """Plans by bucket signature key."""
        return self.store.plans

    @property
    def plan(self) -> Plan | None:
        """The plan of the latest training call."""
        return self.resolver.current_plan

    @property
    def n_solved(self) -> int:
        """Plans solved in this process (not replayed, loaded or received)."""
        return self.resolver.n_solved

    @property
    def n_replayed(self) -> int:
        """Steps built from a known plan."""
        return self.resolver.n_replayed

    # --- the forward ---------------------------------------------------------------------
    def dispatcher(self, real_forward: Callable) -> Callable:
        """The function to put in place of ``module.forward``; it calls ``real_forward`` where no plan applies."""
        return self._dispatch.forward_for(real_forward)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Calls to the module run its original forward (for captures made outside the session)."""
        with self._dispatch.bypassed():
            yield

    def record_call(self, run: Callable[[], Any]) -> tuple[tuple, dict]:
        """The arguments of the first training call ``run()`` makes to the module; that call does not run."""
        return self._dispatch.record_call(run)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        say_packing_honoured(self.module, kwargs, turned_off=False)  # NOTE [packed sequences without the cache]
        call = Call.of(self.module, args, kwargs)

        def budget() -> int:
            return self.training_budget(call.args, call.kwargs)

        distributed = dist.world_size() > 1
        step = self.agreement.step_for(call, budget) if distributed else None
        if step is None:
            step = self.resolver.step_for(call, budget)
        else:
            step = self.agreement.calibrated(call, step, budget)  # single-process: in resolver.run
        # ranks run one agreed plan: the agreement re-plans for the output usage all of them saw, never one rank
        # alone (NOTE [output usage])
        return self.resolver.run(call, step, budget, replan_on_mismatch=not distributed, refine=not distributed)

    # --- budget --------------------------------------------------------------------------
    def training_budget(self, args: tuple, kwargs: dict) -> int:
        """The step's budget in bytes, less the optimizer state the first ``optimizer.step()`` will create."""
        total = parse_budget(self.config.budget, device_of(args, kwargs, self.module))
        pending = pending_state_bytes(self.optimizers())
        budget = total - pending
        if budget <= 0:
            raise InfeasibleBudgetError(total, total + pending, what="training step (its optimizer state alone)")
        log.debug("remat_plugin: budget %s (%s) less %s of optimizer state still to be created: %s for forward+backward",
                 human_bytes(total), self.config.budget, human_bytes(pending), human_bytes(budget))
        return budget

    # --- persistence -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plans as JSON, keyed by bucket: what a checkpoint carries so a resumed run does not re-solve."""
        return self.store.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.store.load_state_dict(state)
