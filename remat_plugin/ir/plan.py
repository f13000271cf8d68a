"""The plan record: what was decided for one input signature and what it is predicted to cost.

Plain data passed from planning to the runtime, stored in checkpoints and plan caches as JSON
(schema versioned), printed as a table.  :func:`safety_margin` is the part of a budget no plan
may use; the planner (:mod:`remat_plugin.planning.choose_plan`) and the replay check both apply it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from remat_plugin.errors import human_bytes

PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class BlockChoice:
    index: int
    n_fwd_ops: int
    mode: str  # "keep" (no recomputation), "recompute" (an ILP option), "checkpoint" (F_none, recomputed from a stored input)
    kept_bytes: int
    recompute_ms: float
    n_recomputed_ops: int = 0  # forward ops of the block run again in the backward (counted once each)


@dataclass(frozen=True)
class Plan:
    """A plan as plain data: what was decided and what it is predicted to cost."""

    budget_bytes: int
    margin_bytes: int  # kept back from the budget for allocator rounding and unseen temporaries
    predicted_peak_bytes: int
    predicted_time_ms: float
    baseline_peak_bytes: int
    baseline_time_ms: float
    min_feasible_bytes: int
    blocks: tuple[BlockChoice, ...]
    n_unique_blocks: int
    planning_s: float = 0.0
    signature: str = ""
    fallback: str | None = None  # why a module-level plan was used instead, if it was
    graph_key: str = ""  # the joint graph's ops (steps.graph_key): a schedule replays only on the same graph
    schema_version: int = PLAN_SCHEMA_VERSION
    schedule: tuple[str, ...] = field(default=(), repr=False)
    # Memory while each op runs (forward ops first), planned and unmodified: filled by `remat plan --json`
    # for `remat report`; empty otherwise, to keep checkpoints small.
    timeline_bytes: tuple[int, ...] = field(default=(), repr=False)
    baseline_timeline_bytes: tuple[int, ...] = field(default=(), repr=False)
    n_fwd_ops: int = 0
    notes: tuple[str, ...] = ()  # what the user should know about how it was found (glued blocks, greedy menus)
    # Outputs (flat tensor positions) the plan frees once the forward returns them: the caller was seen
    # dropping them before backward (NOTE [dropped outputs] in remat_plugin.capture.joint).
    dropped_outputs: tuple[int, ...] = ()
    # Outputs the caller was seen holding through backward that no gradient reached: with the dropped ones,
    # their gradients are left out of the backward program (NOTE [dropped tangents] in
    # remat_plugin.capture.dropped_tangents).
    ungraded_outputs: tuple[int, ...] = ()
    # A first plan that stepped down (NOTE [loss-only first plan] in remat_plugin.runtime.resolver): the floors of
    # the uses its backward refuses, the other outputs differentiated and, where it frees them because no plan
    # that holds them fits, held without a gradient (a plan that frees them for a caller that drops them has the
    # first only: NOTE [refined step-down]).  It travels with the plan (ranks, the disk cache), so every step
    # running it refuses alike.
    loss_only_floors: tuple[int, ...] = ()
    # Where planning's time went, in order: (stage, seconds); capture stages come from the runtime,
    # "block menus" and "budget search" from the planner.  Empty for replayed and fallback plans.
    planning_stages: tuple[tuple[str, float], ...] = ()
    # (op, bytes) of the ops that had kernel scratch when planned (NOTE [temporary memory]): measured again where the
    # plan is replayed on other shapes, so the simulator's check there includes their scratch.
    scratch_ops: tuple[tuple[str, int], ...] = ()
    # False where a search stopped at a wall-clock safety net instead of its work limit (NOTE [work, not time] in
    # remat_plugin.planning.solvers.pulp_backend): the same problem may then be planned otherwise in another process.
    reproducible: bool = True

    @property
    def refuses_holding(self) -> bool:
        """A first plan that frees the outputs beside the loss because no plan holding them fits: its backward
        refuses a caller that holds them, and ``loss_only_floors[1]`` is what that needs.  One refined for a caller
        that drops them has one floor and does not refuse (NOTE [refined step-down])."""
        return bool(self.dropped_outputs) and len(self.loss_only_floors) > 1

    @property
    def predicted_overhead(self) -> float:
        """Predicted step time over the unmodified step time (1.0 = no recomputation)."""
        return self.predicted_time_ms / self.baseline_time_ms if self.baseline_time_ms else 1.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> Plan:
        data = json.loads(text)
        if data.get("schema_version") != PLAN_SCHEMA_VERSION:
            raise ValueError(f"remat_plugin: plan schema {data.get('schema_version')} is not {PLAN_SCHEMA_VERSION}")
        data["blocks"] = tuple(BlockChoice(**b) for b in data["blocks"])
        for name in ("schedule", "timeline_bytes", "baseline_timeline_bytes", "notes", "dropped_outputs",
                     "ungraded_outputs", "loss_only_floors"):
            data[name] = tuple(data.get(name, ()))
        data["scratch_ops"] = tuple((str(n), int(b)) for n, b in data.get("scratch_ops", ()))
        data["planning_stages"] = tuple((str(n), float(s)) for n, s in data.get("planning_stages", ()))
        return Plan(**data)

    def table(self) -> str:
        if self.fallback:  # sized by metered steps (NOTE [metered fallback]) once its predicted peak is known
            if self.predicted_peak_bytes < 0:
                return (f"remat plan  budget {human_bytes(self.budget_bytes)}  FALLBACK: {self.fallback} (not metered "
                        "yet: every layer checkpointed, the budget not verified)")
            checkpointed = sum(b.mode == "checkpoint" for b in self.blocks)
            return (f"remat plan  budget {human_bytes(self.budget_bytes)}  FALLBACK: {self.fallback}; "
                    f"{checkpointed} of {len(self.blocks)} layers checkpointed, measured peak "
                    f"{human_bytes(self.predicted_peak_bytes)} (unmodified {human_bytes(self.baseline_peak_bytes)})")
        floor = human_bytes(self.min_feasible_bytes) if self.min_feasible_bytes >= 0 else "not computed"
        lines = [
            (
                f"remat plan  budget {human_bytes(self.budget_bytes)} (margin {human_bytes(self.margin_bytes)})"
                f"  predicted peak {human_bytes(self.predicted_peak_bytes)}"
                f" (unmodified {human_bytes(self.baseline_peak_bytes)},"
                f" smallest feasible {floor})"
            ),
            (
                f"predicted overhead {self.predicted_overhead:.3f}x  blocks {len(self.blocks)}"
                f" ({self.n_unique_blocks} unique)  planned in {self.planning_s:.1f} s"
                + ("" if self.reproducible else "  NOT REPRODUCIBLE (a search reached its time limit)")
            ),
            f"{'block':>5} {'fwd ops':>7} {'mode':>10} {'kept':>12} {'recomputed':>10} {'recompute ms':>12}",
        ]
        lines[2:2] = [f"note: {note}" for note in self.notes]
        for b in self.blocks:
            lines.append(f"{b.index:>5} {b.n_fwd_ops:>7} {b.mode:>10} {human_bytes(b.kept_bytes):>12} "
                         f"{b.n_recomputed_ops:>10} {b.recompute_ms:>12.3f}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


MARGIN_MIN_BYTES = 64 * 1024


def safety_margin(budget_bytes: int) -> int:
    """Bytes kept back from a budget for what the model does not see (allocator rounding, tiny temporaries)."""
    return max(MARGIN_MIN_BYTES, budget_bytes // 200)


def budget_for_peak(peak_bytes: int) -> int:
    """The smallest budget whose usable part (budget minus margin) holds ``peak_bytes``."""
    budget = max(peak_bytes + MARGIN_MIN_BYTES, peak_bytes * 200 // 199 - 2)
    while budget - safety_margin(budget) < peak_bytes:
        budget += 1
    return budget
