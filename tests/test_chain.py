"""rk-Rotor chain DP: its claims checked against replay() and a brute force over schedules."""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import replace

import pytest

from remat_plugin.ir.simulate import InvalidScheduleError
from remat_plugin.planning.solvers.chain import (
    ChainAction,
    ChainBlock,
    ChainOption,
    min_feasible_budget,
    replay,
    solve_chain,
)

logger = logging.getLogger(__name__)


def random_chain(n_blocks: int, n_options: int, rng: random.Random, unit_bytes: int = 1000,
                 held: bool = False) -> list[ChainBlock]:
    """A heterogeneous chain whose options trade kept memory for backward time.  ``held``: some blocks' inputs are
    values the caller gets (``held_bytes``), alive from the block's backward to the end of the step."""
    blocks = []
    x_in = rng.randint(1, 10) * unit_bytes
    for i in range(n_blocks):
        x_out = rng.randint(1, 10) * unit_bytes
        options = []
        for o in range(n_options):
            kept = rng.randint(0, 30) * unit_bytes
            options.append(ChainOption(
                kept_bytes=kept,
                fwd_peak_bytes=x_out + kept + rng.randint(0, 5) * unit_bytes,
                bwd_peak_bytes=x_in + rng.randint(0, 20) * unit_bytes,
                fwd_ms=1.0 + rng.random(),
                bwd_ms=1.0 + (n_options - o) * 0.5 * rng.random() + rng.random(),
            ))
        blocks.append(ChainBlock(
            input_bytes=x_in, output_bytes=x_out, grad_input_bytes=0 if i == 0 else rng.randint(1, 12) * unit_bytes,
            param_grad_bytes=rng.randint(0, 3) * unit_bytes,
            none_fwd_ms=0.5 + rng.random(), none_fwd_peak_bytes=x_out + rng.randint(0, 5) * unit_bytes,
            options=tuple(options), held_bytes=x_in if held and i > 0 and rng.random() < 0.5 else 0))
        x_in = x_out
    return blocks


def all_schedules(blocks: list[ChainBlock], s: int, t: int) -> list[tuple[ChainAction, ...]]:
    """Every action sequence of the rk-Rotor form for blocks s..t (both cases, every option and split)."""
    out = []
    for o in range(len(blocks[s].options)):
        rests = all_schedules(blocks, s + 1, t) if s < t else [()]
        out += [(ChainAction("fwd", s, o),) + rest + (ChainAction("bwd", s, o),) for rest in rests]
    for s_ckpt in range(s + 1, t + 1):
        head = tuple(ChainAction("fwd_none", j) for j in range(s, s_ckpt))
        for right, left in itertools.product(all_schedules(blocks, s_ckpt, t), all_schedules(blocks, s, s_ckpt - 1)):
            out.append(head + right + left)
    return out


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 4])
def test_dp_matches_brute_force(n_blocks: int, held: bool) -> None:
    """With one-byte slots the DP time equals the best replay-feasible schedule of the same form; ``held``: with
    chain values the caller gets, which stay alive after their block's backward."""
    rng = random.Random(n_blocks)
    for trial in range(6):
        blocks = random_chain(n_blocks, 2, rng, unit_bytes=1, held=held)
        costs = [replay(blocks, sched) for sched in all_schedules(blocks, 0, n_blocks - 1)]
        for budget in sorted({peak for peak, _ in costs})[::2] + [min(p for p, _ in costs) - 1]:
            best = min((ms for peak, ms in costs if peak <= budget), default=None)
            plan = solve_chain(blocks, budget, n_slots=budget)
            if best is None:
                assert plan is None, (trial, budget)
            else:
                assert plan is not None, (trial, budget, best)
                assert plan.time_ms == pytest.approx(best), (trial, budget)
                assert plan.peak_bytes <= budget


@pytest.mark.parametrize("held", [False, True])
def test_replayed_peak_within_budget(held: bool) -> None:
    """Whatever the budget, the plan's replayed peak fits it (rounding is conservative)."""
    rng = random.Random(7)
    for _ in range(8):
        blocks = random_chain(rng.randint(3, 12), rng.randint(1, 5), rng, held=held)
        full = solve_chain(blocks, 10**12)
        for frac in [0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0]:
            budget = int(full.peak_bytes * frac)
            plan = solve_chain(blocks, budget, n_slots=rng.choice([50, 200, 500]))
            if plan is not None:
                assert replay(blocks, plan.actions) == (plan.peak_bytes, pytest.approx(plan.time_ms))
                assert plan.peak_bytes <= budget, (plan.peak_bytes, budget)


def test_more_memory_never_slower() -> None:
    """Time never rises with the budget (slot sizes only shrink as it grows)."""
    rng = random.Random(11)
    for _ in range(4):
        blocks = random_chain(10, 4, rng)
        low = min_feasible_budget(blocks)
        previous = float("inf")
        for budget in range(low, 4 * low, max(1, low // 20)):
            plan = solve_chain(blocks, budget)
            assert plan is not None
            assert plan.time_ms <= previous + 1e-9, budget
            previous = plan.time_ms


def test_min_feasible_budget_is_tight() -> None:
    """To the byte (tolerance 0), one byte below the least budget there is no plan and at it there is one;
    with the default tolerance, the budget found has a plan and lies within it of the least."""
    rng = random.Random(3)
    for n_slots in [20, 500]:
        for _ in range(4):
            blocks = random_chain(rng.randint(2, 10), 3, rng)
            low = min_feasible_budget(blocks, n_slots=n_slots, tolerance=0)
            near = min_feasible_budget(blocks, n_slots=n_slots)
            assert low <= near <= low * (1 + 1 / 1024) + 1 and solve_chain(blocks, near, n_slots=n_slots) is not None
            assert solve_chain(blocks, low - 1, n_slots=n_slots) is None
            assert solve_chain(blocks, low // 2, n_slots=n_slots) is None
            plan = solve_chain(blocks, low, n_slots=n_slots)
            assert plan is not None and plan.peak_bytes <= low


def test_held_values_stay_alive_to_the_end() -> None:
    """NOTE [chain memory model]: a chain value the caller gets (``held_bytes`` of the block it feeds) is not freed
    by that block's backward: the earlier blocks' backwards run beside it."""
    option = ChainOption(kept_bytes=0, fwd_peak_bytes=0, bwd_peak_bytes=0, fwd_ms=1.0, bwd_ms=1.0)
    first = ChainBlock(0, 100, 0, 0, 1.0, 100, (replace(option, bwd_peak_bytes=50),))
    actions = [ChainAction("fwd", 0, 0), ChainAction("fwd", 1, 0), ChainAction("bwd", 1, 0), ChainAction("bwd", 0, 0)]
    # bwd(1): x_1 (100), the loss x_2 (10) and δ_1 (40), 150; bwd(0): δ_1 and its own 50, 90, and x_1 when held, 190
    for held, peak in ((0, 150), (100, 190)):
        second = ChainBlock(100, 10, 40, 0, 1.0, 10, (option,), held_bytes=held)
        assert replay([first, second], actions) == (peak, 4.0)
        assert solve_chain([first, second], peak, n_slots=peak) is not None
        assert solve_chain([first, second], peak - 1, n_slots=peak - 1) is None


def test_huge_budget_runs_fastest_options_once() -> None:
    """With room for everything, each block runs once with its fastest option, all forwards first."""
    rng = random.Random(5)
    blocks = random_chain(8, 4, rng)
    plan = solve_chain(blocks, 10**12)
    fastest = [min(range(4), key=lambda o, b=b: b.options[o].fwd_ms + b.options[o].bwd_ms) for b in blocks]
    expected = ([ChainAction("fwd", i, o) for i, o in enumerate(fastest)]
                + [ChainAction("bwd", i, fastest[i]) for i in reversed(range(8))])
    assert list(plan.actions) == expected
    assert plan.time_ms == pytest.approx(sum(b.options[o].fwd_ms + b.options[o].bwd_ms
                                             for b, o in zip(blocks, fastest)))


def test_edge_cases() -> None:
    """Empty chain, zero budget, and a zero-size chain behave."""
    assert solve_chain([], 0).actions == ()
    rng = random.Random(1)
    assert solve_chain(random_chain(3, 2, rng), 0) is None
    zero = ChainBlock(0, 0, 0, 0, 1.0, 0, (ChainOption(0, 0, 0, 1.0, 1.0),))
    plan = solve_chain([zero, zero], 0)
    assert plan is not None and plan.peak_bytes == 0 and plan.time_ms == pytest.approx(4.0)
    assert min_feasible_budget([zero, zero]) == 0


def test_replay_rejects_invalid_sequence() -> None:
    """A backward before its forward is refused by replay()."""
    blocks = random_chain(2, 1, random.Random(0))
    with pytest.raises(InvalidScheduleError, match="chain replay"):
        replay(blocks, [ChainAction("fwd", 0, 0), ChainAction("bwd", 0, 0)])


@pytest.mark.parametrize(("n_blocks", "bound_s"), [(14, 1.0), (100, 5.0)])
def test_dp_time(n_blocks: int, bound_s: float) -> None:
    """The DP at 500 slots with 10 options per block is fast enough to rerun per budget."""
    rng = random.Random(42)
    blocks = random_chain(n_blocks, 10, rng)
    budget = solve_chain(blocks, 10**12).peak_bytes // 3
    solve_chain(blocks, budget)  # warm numpy
    start = time.perf_counter()
    plan = solve_chain(blocks, budget, n_slots=500)
    elapsed_s = time.perf_counter() - start
    logger.warning("chain DP, %d blocks, 500 slots, 10 options: %.1f ms", n_blocks, elapsed_s * 1e3)
    assert plan is not None and plan.peak_bytes <= budget
    assert elapsed_s < bound_s
