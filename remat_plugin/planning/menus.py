"""The planner's per-problem state: blocks, their ILP menus, chain blocks, and chain → schedule assembly.

Blocks and menus depend on the problem, not on the budget, so one :class:`Planner` serves
every budget tried for a problem.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import Simulation, simulate
from remat_plugin.planning.blocks import (
    GLUED_SHARE,
    Block,
    forward_only_peak,
    glued_values,
    make_blocks,
    rename_schedule,
)
from remat_plugin.planning.solvers.chain import (
    ChainAction,
    ChainBlock,
    ChainOption,
    ChainPlan,
    min_feasible_budget,
    solve_chain,
)
from remat_plugin.planning.solvers.greedy_menu import greedy_menu
from remat_plugin.planning.solvers.ilp import BlockIlp, BlockOption, block_menu, block_option, pareto
from remat_plugin.planning.solvers.kept_paths import kept_path_menu

log = logging.getLogger(__name__)

# NOTE [big blocks]
#     A block that could not be cut (its values glued, see planning.blocks) can hold hundreds of
#     forward ops; the ILP's variables grow with the square of that (541K variables and minutes of
#     building at 8 glued Llama layers).  Above this many forward ops a block's menu comes from
#     greedy.greedy_menu instead (every option checked by the simulator), and the plan says so.
MAX_ILP_FWD_OPS = 120

# Each block ILP solve's wall-clock safety net: solves stop on counts of work (NOTE [work, not time] in
# solvers.pulp_backend), and one that reaches this instead makes the plan not reproducible, with a warning.  Far
# above what the counts cost (the slowest solve of an 8-layer llama-tiny's menus took a few seconds quiet), so that
# a busy machine does not reach it: at 10 s one CI run's floor search on that model came out otherwise.  Solves
# that find no integer solution fall back to a rounded LP relaxation (checked by the simulator).  A block's menu
# solves its ILP twice per extreme (its least peak or kept bytes, then the least recompute there); the rest of the
# menu comes from kept paths (NOTE [kept paths]).
DEFAULT_ILP_TIME_LIMIT_S = 60.0


def _moved(option: BlockOption, source: Block, target: Block) -> BlockOption:
    """``option`` of ``source`` as an option of the identical block ``target`` (same costs, its op names)."""
    return replace(option, schedule=rename_schedule(option.schedule, source.problem, target.problem))


@dataclass
class Planner:
    """Holds the per-problem work (blocks, menus) so several budgets can be tried cheaply."""

    problem: Problem
    constants: set[str]
    ilp_time_limit_s: float = DEFAULT_ILP_TIME_LIMIT_S
    n_slots: int = 500
    blocks: list[Block] = field(default_factory=list)
    menus: list[tuple[BlockOption, ...]] = field(default_factory=list)
    chain: list[ChainBlock] = field(default_factory=list)
    n_unique: int = 0
    first_of: dict[tuple, Block] = field(default_factory=dict)  # block key -> the block its menu was solved on
    greedy_blocks: list[int] = field(default_factory=list)  # blocks too big for the ILP (NOTE [big blocks])
    lowest: tuple[Schedule, Simulation, ChainPlan] | None = None  # see budget_search.lowest_peak
    # Menus solved for other problems, by block structure (NOTE [menus across shapes]); shared by a PlannerCache.
    solved_elsewhere: dict[tuple, tuple[Block, tuple[BlockOption, ...]]] | None = None
    n_transferred: int = 0  # unique blocks whose menu came from solved_elsewhere
    solved_keys: set[tuple] = field(default_factory=set)  # unique blocks whose menu was solved here
    chosen: list[tuple[Schedule, Simulation, ChainPlan]] = field(default_factory=list)  # plans made, see remember
    notes: list[str] = field(default_factory=list)  # for Plan.notes
    # Searches stopped by a wall-clock safety net instead of their work limits (NOTE [work, not time]): what this
    # planner found may differ in another process, and every plan it makes says so (Plan.reproducible).
    safety_net_hits: list[str] = field(default_factory=list)
    simulated_ops: int = 0  # op positions simulated by evaluate: the searches' measure of work
    # (kind, block, option) -> that action's ops; menus only grow, so an action's ops never change
    _fragments: dict[tuple[str, int, int], tuple[str, ...]] = field(default_factory=dict, repr=False)
    # backward sequence -> (schedule, simulation), while a search runs (see evaluate)
    _evaluated: dict[tuple[str, ...], tuple[Schedule, Simulation]] = field(default_factory=dict, repr=False)

    def prepare(self, progress=None) -> None:
        self.blocks = make_blocks(self.problem, self.constants)
        first_of = self.first_of
        for b in self.blocks:
            first_of.setdefault(b.key, b)
        self.n_unique = len(first_of)

        elsewhere = self.solved_elsewhere if self.solved_elsewhere is not None else {}
        known = {key: elsewhere.get(b.structure) for key, b in first_of.items()}
        self.n_transferred = sum(k is not None for k in known.values())
        self.solved_keys = {key for key, k in known.items() if k is None}

        def menu_of(b: Block) -> tuple[BlockOption, ...]:
            source = known[b.key]
            if source is not None:
                return transferred_menu(*source, b)
            if len(b.fwd_ops) > MAX_ILP_FWD_OPS:
                return greedy_menu(b.problem)
            ilp = BlockIlp.build(b.problem)
            lowest = block_menu(b.problem, n_peak=1, n_kept=1, time_limit_s=self.ilp_time_limit_s,
                                extremes=("kept", "peak"), ilp=ilp)
            if ilp.timed_out:
                self.reached_safety_net(f"block {b.index}'s ILP reached its {self.ilp_time_limit_s:g} s time limit")
            return pareto([*kept_path_menu(b.problem), *lowest])

        # HiGHS releases the GIL while it solves: unique blocks' menus are solved side by side, the
        # biggest ILPs first (their variables grow with forward x backward ops), so that no worker is
        # left with one big block at the end while the others idle.
        solved: dict[tuple, tuple[Block, tuple[BlockOption, ...]]] = {}
        workers = max(1, min(len(first_of), os.cpu_count() or 1, 4))
        biggest_first = sorted(first_of.items(), key=lambda kb: -len(kb[1].fwd_ops) * len(kb[1].bwd_ops))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {key: pool.submit(menu_of, b) for key, b in biggest_first}
            for done, (key, fut) in enumerate(futures.items(), 1):
                solved[key] = (first_of[key], fut.result())
                if progress is not None:
                    progress(done, len(first_of))
        for b in self.blocks:
            src, menu = solved[b.key]
            self.menus.append(menu if src is b else tuple(_moved(o, src, b) for o in menu))
        if self.solved_elsewhere is not None:
            for src, menu in solved.values():
                self.solved_elsewhere[src.structure] = (src, menu)
        if self.n_transferred:
            log.debug("remat_plugin.planning: %d of %d unique blocks took menus solved at other sizes",
                      self.n_transferred, self.n_unique)
        self.chain = [self._chain_block(b, m) for b, m in zip(self.blocks, self.menus)]
        self.greedy_blocks = [b.index for b in self.blocks if len(b.fwd_ops) > MAX_ILP_FWD_OPS]
        if self.greedy_blocks:
            self.notes.append(f"blocks {self.greedy_blocks} have more than {MAX_ILP_FWD_OPS} forward ops: their options "
                              "come from a greedy keep/recompute rule checked by the simulator, not the ILP")
        glue = glued_values(self.problem, self.constants, self.blocks)
        if glue:
            self.notes.append(f"a block holds more than {GLUED_SHARE:.0%} of the forward ops; values alive across it "
                              f"keep it from being cut: {', '.join(glue)}")
        for note in self.notes:
            log.warning("remat_plugin: %s", note)

    def _chain_block(self, b: Block, menu: tuple[BlockOption, ...]) -> ChainBlock:
        size = (lambda v: self.problem.value(v).size_bytes if v else 0)
        fwd_ms = sum(self.problem.op(n).time_ms for n in b.fwd_ops)
        param_grads = sum(
            self.problem.value(v).size_bytes for n in b.bwd_ops for v in self.problem.op(n).outputs
            if v in self.problem.live_out
        )
        return ChainBlock(
            input_bytes=size(b.input_value),
            output_bytes=size(b.output_value),
            grad_input_bytes=size(b.input_value),
            param_grad_bytes=param_grads,
            none_fwd_ms=fwd_ms,
            none_fwd_peak_bytes=forward_only_peak(b.problem, b.output_value),
            options=self._chain_options(b, menu),
            side_bytes=b.side_bytes,
            held_bytes=self._held_bytes(b),
        )

    def _held_bytes(self, b: Block) -> int:
        """The chain values the caller gets that the DP frees at ``b``'s backward: its input, and the last block's
        output (NOTE [chain memory model]).  A model returning its logits beside the loss holds them to the end."""
        last = b.index == len(self.blocks) - 1
        held = [v for v in (b.input_value, b.output_value if last else None)
                if v and v in self.problem.live_out and self.problem.op(self.problem.value(v).producer).is_fwd]
        return sum(self.problem.value(v).size_bytes for v in held)

    def _chain_options(self, b: Block, menu: tuple[BlockOption, ...]) -> tuple[ChainOption, ...]:
        """A menu as the chain DP sees it; the rest of a chain block does not depend on the menu, so a changed menu
        remakes only this (the floor search changes menus hundreds of times on a deep model)."""
        output_bytes = self.problem.value(b.output_value).size_bytes if b.output_value else 0
        not_last = b.index < len(self.blocks) - 1
        options = []
        for o in menu:
            # NOTE [outputs in kept sets]
            kept = o.kept_bytes - (output_bytes if not_last and _keeps(b.problem, o.schedule, b.output_value) else 0)
            # The DP counts δ_{i+1} (the size of x_{i+1}) alive through the whole backward action; the
            # block's timeline counts it until its last read (NOTE [incoming gradients]).
            options.append(ChainOption(kept, o.fwd_peak_bytes, max(0, o.bwd_peak_bytes - kept - output_bytes),
                                       o.fwd_ms, o.bwd_ms))
        return tuple(options)

    def assemble(self, chain_plan: ChainPlan) -> Schedule:
        """The whole-graph backward sequence realising a chain plan (the first forward pass is implicit)."""
        return self.assemble_spans(chain_plan)[0]

    def assemble_spans(self, chain_plan: ChainPlan) -> tuple[Schedule, list[tuple[int, int]]]:
        """:meth:`assemble`, and for each action from the first ``bwd`` on, its (start, end) in the sequence."""
        actions = list(chain_plan.actions)
        first_bwd = next(i for i, a in enumerate(actions) if a.kind == "bwd")
        seq: list[str] = []
        spans: list[tuple[int, int]] = []
        for a in actions[first_bwd:]:
            start = len(seq)
            seq.extend(self._fragment(a))
            spans.append((start, len(seq)))
        return Schedule(tuple(seq)), spans

    def _fragment(self, a: ChainAction) -> tuple[str, ...]:
        """The ops one chain action runs: a menu option's backward, or the forward ops remaking what it needs."""
        key = (a.kind, a.block, a.option)
        found = self._fragments.get(key)
        if found is None:
            b = self.blocks[a.block]
            if a.kind == "bwd":
                found = tuple(self.menus[a.block][a.option].schedule.bwd_sequence)
            else:
                wanted = {b.output_value} if b.output_value else set()
                if a.kind == "fwd":
                    wanted |= kept_reads(b.problem, self.menus[a.block][a.option].schedule)
                found = tuple(_ancestors_in_order(b.problem, wanted))
            self._fragments[key] = found
        return found

    def evaluate(self, chain_plan: ChainPlan) -> tuple[Schedule, Simulation]:
        """A chain plan's whole-graph schedule and its simulation, each schedule simulated once per search: the
        descent and the climbs come back to schedules already judged (4 in 10 of them on a 16-layer Llama)."""
        sched = self.assemble(chain_plan)  # cheap; different plans often make the same schedule
        found = self._evaluated.get(sched.bwd_sequence)
        if found is None:
            found = self._evaluated[sched.bwd_sequence] = (sched, simulate(self.problem, sched))
            self.simulated_ops += len(found[1].timeline_bytes)
        return found

    def reached_safety_net(self, what: str) -> None:
        """A search stopped by a clock, not by its work limit: say so once and mark the plans made here."""
        if not self.safety_net_hits:
            log.warning("remat_plugin: %s before its work limit; the plan may differ in another process (its JSON "
                        "says reproducible: false)", what)
        self.safety_net_hits.append(what)

    def end_search(self) -> None:
        """Drop the simulations :meth:`evaluate` kept (each holds a timeline as long as the step)."""
        self._evaluated.clear()

    def blocks_at_peak(self, chain_plan: ChainPlan, sim: Simulation) -> list[int]:
        """Blocks whose option choice counts at the simulated peak: the one running, and those holding kept sets.

        Only these can lower that moment's memory by changing options (NOTE [chain memory model]).
        """
        return self.running_at_peak(chain_plan, sim)[1]

    def running_at_peak(self, chain_plan: ChainPlan, sim: Simulation) -> tuple[int | None, list[int]]:
        """The block running at the simulated peak (None where the peak is in no block: a constant op, the synthetic
        tangents op), and :meth:`blocks_at_peak` (every block where none runs there)."""
        n_fwd = len(self.problem.fwd_ops)
        peak_at = max(range(len(sim.timeline_bytes)), key=sim.timeline_bytes.__getitem__)
        actions = list(chain_plan.actions)
        first_bwd = next(i for i, a in enumerate(actions) if a.kind == "bwd")
        if peak_at < n_fwd:  # in the first forward pass: the block making that op
            name = self.problem.fwd_ops[peak_at].name
            found = next((i for i, a in enumerate(actions[:first_bwd]) if name in self.blocks[a.block].fwd_ops), None)
        else:
            _, spans = self.assemble_spans(chain_plan)
            found = next((first_bwd + i for i, (s, e) in enumerate(spans) if s <= peak_at - n_fwd < e), None)
        if found is None:  # a constant op (in no block) or the synthetic tangents op: every block may count
            return None, sorted({a.block for a in actions if a.kind == "bwd"})
        at = found
        holding = []
        for i, a in enumerate(actions):
            if a.kind == "fwd" and i <= at:
                done = any(b.kind == "bwd" and b.block == a.block for b in actions[i + 1 : at])
                if not done:
                    holding.append(a.block)
        return actions[at].block, sorted({actions[at].block, *holding})

    def add_option(self, block: Block, option: BlockOption) -> int:
        """Give ``block`` and every block identical to it one more menu option; its index in their menus."""
        self._set_menus(block, lambda b, menu: (*menu, _moved(option, block, b)))
        return len(self.menus[block.index]) - 1

    def drop_last_option(self, block: Block) -> None:
        """Undo :meth:`add_option`: no plan made since may use that option."""
        index = len(self.menus[block.index]) - 1
        self._set_menus(block, lambda b, menu: menu[:-1])
        for b in self._identical(block):
            for kind in ("fwd", "bwd"):
                self._fragments.pop((kind, b.index, index), None)

    def _set_menus(self, block: Block, change) -> None:
        """``change(b, menu)`` as the menu of ``block`` and of every block identical to it, their chain blocks remade."""
        for b in self._identical(block):
            self.menus[b.index] = change(b, self.menus[b.index])
            self.chain[b.index] = replace(self.chain[b.index], options=self._chain_options(b, self.menus[b.index]))

    def _identical(self, block: Block) -> list[Block]:
        """``block`` and the blocks identical to it (one menu serves them all)."""
        return [b for b in self.blocks if b.key == block.key]

    def remember(self, candidate: tuple[Schedule, Simulation, ChainPlan], max_kept: int = 32) -> None:
        """Keep a plan made at some budget: a later, larger budget takes it if nothing faster is found."""
        self.chosen = [candidate, *self.chosen][:max_kept]

    def fitting(self, budget_bytes: int) -> list[tuple[Schedule, Simulation, ChainPlan]]:
        """Plans remembered whose simulated peak fits ``budget_bytes``."""
        return [c for c in self.chosen if c[1].peak_bytes <= budget_bytes]

    def try_budget(self, dp_budget: int) -> tuple[Schedule, Simulation, ChainPlan] | None:
        cp = solve_chain(self.chain, dp_budget, self.n_slots)
        if cp is None:
            return None
        return (*self.evaluate(cp), cp)

    def min_dp_budget(self) -> int:
        return min_feasible_budget(self.chain, self.n_slots)


# NOTE [menus across shapes]
#     A block's menu is a set of schedules: which forward ops its backward recomputes, and when.
#     Whether a schedule is valid depends only on the block's structure (structure_key: ops, their
#     inputs, what stays alive), not on sizes or times.  So a block with the structure of one solved
#     before (at another batch size, sequence length, or with another output dropped) takes that
#     menu's schedules, each re-costed by the simulator at its own sizes, instead of solving its ILPs.
#     All activation sizes scale together with the batch, so the menu stays near the one its ILPs
#     would give; kept paths (NOTE [kept paths]) are cheap, so they are walked again at the new sizes.
def transferred_menu(source: Block, menu: tuple[BlockOption, ...], target: Block) -> tuple[BlockOption, ...]:
    """``source``'s menu as ``target``'s: the same options where the blocks are identical, else re-costed."""
    if source.problem == target.problem:
        return tuple(_moved(o, source, target) for o in menu)
    moved = [block_option(target.problem, rename_schedule(o.schedule, source.problem, target.problem)) for o in menu]
    return pareto([*moved, *kept_path_menu(target.problem)])  # kept paths are cheap: walked again at these sizes


# NOTE [outputs in kept sets]
#     A block whose backward reads its own output x_{i+1} (the sum a residual add makes, read by the
#     LayerNorm after it) keeps it: the option's kept bytes count it.  The chain DP counts x_{i+1} too,
#     from fwd(i) until bwd(i+1), its last read as the DP sees it, so for that span it counted the
#     value twice (on bert-tiny at 0.3 of the peak, up to 19 MB over the simulator in one backward).
#     So the option the DP gets keeps the rest only; bwd(i) always comes right after bwd(i+1) (or
#     after the fwd(i) that remade x_{i+1}), so only its backward transient must count x_{i+1} again,
#     which the same subtraction gives.  The last block's output doubles as the loss in the DP and is
#     left as it is.
def _keeps(problem: Problem, schedule: Schedule, value: str | None) -> bool:
    """Whether ``schedule``'s backward reads ``value`` before remaking it: it is kept from the forward."""
    if value is None:
        return False
    for name in schedule.bwd_sequence:
        op = problem.op(name)
        if value in op.inputs:
            return True
        if value in op.outputs:
            return False
    return False


def kept_reads(problem: Problem, schedule: Schedule) -> set[str]:
    made: set[str] = set()
    kept: set[str] = set()
    for name in schedule.bwd_sequence:
        op = problem.op(name)
        kept.update(v for v in op.inputs if v not in made)
        made.update(op.outputs)
    fwd_made = {v for o in problem.fwd_ops for v in o.outputs}
    return kept & fwd_made


def _ancestors_in_order(problem: Problem, wanted: set[str]) -> list[str]:
    """Forward ops (recomputable, in order) needed to make ``wanted`` from the block's inputs."""
    need = set(wanted)
    chosen: list[str] = []
    for op in reversed(problem.fwd_ops):
        if need & set(op.outputs) and op.recomputable:
            chosen.append(op.name)
            need.update(op.inputs)
    return list(reversed(chosen))
