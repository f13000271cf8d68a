"""rk-Rotor: the chain dynamic program over blocks that each offer a menu of options.

The model is a chain of blocks ``0..n-1``.  Block ``i`` reads ``x_i`` and makes
``x_{i+1}``; its backward reads ``δ_{i+1}`` and makes ``δ_i`` plus parameter gradients
that stay alive to the end of the step.  A block either runs ``fwd_none`` (keeps only
its output) or ``fwd`` with one option of its menu (keeps that option's internal
values until its ``bwd``).

NOTE [chain memory model]
    Memory is counted above what is alive at step start; ``x_0`` is external and free.
    ``replay`` is the spec: an action's transient is ``max(declared peak, bytes it
    makes)`` plus its block's ``side_bytes`` (values made outside the chain's bookkeeping,
    alive while the block runs) on top of what was alive; after it, each ``x_i`` it touched is freed
    unless its next event is a read (its last read before being remade or never),
    ``fwd`` adds its kept set, ``bwd(i)`` frees its kept set and ``δ_{i+1}`` and adds
    ``δ_i`` and block ``i``'s parameter gradients.  The loss ``x_n`` doubles as ``δ_n``:
    it is freed by ``bwd(n-1)``.  A chain value the caller gets (a model's logits, a hidden
    state it returns) is not freed: ``bwd(i)`` adds it back as block ``i``'s ``held_bytes``,
    which the recurrence counts with the parameter gradients (``pg``) from then on.

NOTE [rk-Rotor recurrence]
    ``C(s, t, m)``: least time to run blocks ``s..t`` forward and backward with ``m``
    free slots, ``x_s`` and ``δ_{t+1}`` alive (both counted outside ``m``; ``δ_n`` is
    empty).  It ends with ``x_s``, ``δ_{t+1}`` freed and ``δ_s``, ``pg(s..t)`` alive.

    (1) ``fwd(s, o)`` then ``C(s+1, t, m - x_{s+1} - kept_o)`` then ``bwd(s, o)``;
        valid if ``m ≥ fwd_o`` and the memory left for the backward,
        ``m - kept_o + δ_{t+1} - δ_{s+1} - pg(s+1..t)`` (``m - kept_o - [t=n-1]·x_n``
        when ``s = t``), is at least ``bwd_o``.
    (2) for ``s < s' ≤ t``: ``fwd_none`` of ``s..s'-1`` (valid if ``m ≥ none_s`` and
        ``m ≥ x_j + none_j`` for ``s < j < s'``), then ``C(s', t, m - x_{s'})``, then
        ``C(s, s'-1, m + δ_{t+1} - δ_{s'} - pg(s'..t))``.

    ``C(s, t, m) = min`` over both.  Every size is rounded up to whole slots on its
    own, so the slot bookkeeping is an exact replay of rounded sizes, which bounds the
    byte replay from above: a plan the DP accepts always fits the budget in bytes.

NOTE [vectorisation]
    Tables are indexed ``m = 0..M`` and every candidate is a shifted slice of an
    earlier table.  ``D[t][s'][m] = C(s', t, m - x_{s'})`` is shared by all ``s``;
    ``E_s[s'][w] = C(s, s'-1, w + pg(<s') - δ_{s'})`` turns case (2)'s second term into
    one slice at offset ``δ_{t+1} - pg(<t+1)`` for all ``s'`` at once.  Indices above
    ``M`` read ``C(.., M)``: ``C`` falls in ``m``, so this is conservative (and such
    states are not reachable: free memory never exceeds ``M``).  No argmin table is
    kept: the reconstruction re-evaluates only the states it visits, from ``D``, with the
    same float operations, which is cheaper than an argmin over every ``(s, t, m)``.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from remat_plugin.ir.simulate import InvalidScheduleError

logger = logging.getLogger(__name__)

_INF = np.inf


@dataclass(frozen=True)
class ChainOption:
    """One way to run a block so that its backward can follow; found by the block ILP."""

    kept_bytes: int  # block-internal values kept from its forward to its backward
    fwd_peak_bytes: int  # transient peak of its forward above what was alive (x_i); includes x_{i+1}, kept
    bwd_peak_bytes: int  # transient peak of its backward above x_i, kept, δ_{i+1}; includes δ_i, param grads
    fwd_ms: float
    bwd_ms: float


@dataclass(frozen=True)
class ChainBlock:
    """A block's interface sizes and its menu; what the chain DP needs and nothing more."""

    input_bytes: int  # size of x_i (block 0's input is external and never counted)
    output_bytes: int  # size of x_{i+1}
    grad_input_bytes: int  # size of δ_i (0 when the chain input needs no gradient)
    param_grad_bytes: int  # parameter gradients its backward leaves alive to the end of the step
    none_fwd_ms: float
    none_fwd_peak_bytes: int  # peak above what was alive, forward keeping nothing (includes x_{i+1})
    options: tuple[ChainOption, ...]
    side_bytes: int = 0  # made outside the chain's bookkeeping (side values, constants), alive during its actions
    # Chain values the caller gets (``x_i``, or the last block's ``x_n``) that the bookkeeping would free at this
    # block's backward: alive from then to the end of the step, as parameter gradients are (NOTE [chain memory model])
    held_bytes: int = 0


@dataclass(frozen=True)
class ChainAction:
    """One step of the chain schedule."""

    kind: str  # "fwd_none", "fwd" (with option, keeps its kept set) or "bwd" (with option)
    block: int
    option: int = -1


@dataclass(frozen=True)
class ChainPlan:
    """The whole forward+backward sequence and what ``replay`` says it costs."""

    actions: tuple[ChainAction, ...]
    time_ms: float
    peak_bytes: int  # from replay(), bytes above step start


# ---------------------------------------------------------------------------- replay


def _x_events(n: int, actions: Sequence[ChainAction]) -> list[list[tuple[int, bool]]]:
    """Per activation ``x_i``: its (action index, is_read) events; reads beat writes in one action."""
    events: list[list[tuple[int, bool]]] = [[] for _ in range(n + 1)]
    for k, a in enumerate(actions):
        i = a.block
        if a.kind in ("fwd", "fwd_none"):
            events[i].append((k, True))
            events[i + 1].append((k, False))
        elif a.kind == "bwd":
            events[i].append((k, True))
            if i == n - 1:
                events[n].append((k, True))  # the loss stands in for δ_n
        else:
            raise InvalidScheduleError(f"chain replay: unknown action kind {a.kind!r} at step {k}")
    return events


def _x_free_after(n: int, actions: Sequence[ChainAction]) -> list[list[int]]:
    """For each action, the activations whose last read before being remade (or ever) it is."""
    free_after: list[list[int]] = [[] for _ in actions]
    for i, evs in enumerate(_x_events(n, actions)):
        for (k, _), nxt in zip(evs, evs[1:] + [(-1, False)]):
            if not nxt[1] and (not free_after[k] or free_after[k][-1] != i):
                free_after[k].append(i)
    return free_after


def replay(blocks: Sequence[ChainBlock], actions: Sequence[ChainAction]) -> tuple[int, float]:
    """Return ``(peak_bytes, time_ms)`` of an action sequence: the spec the DP must agree with.

    Raises :class:`InvalidScheduleError` when an action reads something not alive.
    """
    n = len(blocks)
    x_bytes = [0] + [b.output_bytes for b in blocks]
    free_after = _x_free_after(n, actions)
    x_alive = [True] + [False] * n
    kept_option: dict[int, int] = {}
    delta_alive = [False] * (n + 1)
    alive_bytes = peak_bytes = 0
    time_ms = 0.0
    for k, a in enumerate(actions):
        i, blk = a.block, blocks[a.block]
        if not x_alive[i]:
            raise InvalidScheduleError(f"chain replay: step {k} {a} reads x_{i}, which is not alive")
        if a.kind in ("fwd", "fwd_none"):
            if x_alive[i + 1]:
                raise InvalidScheduleError(f"chain replay: step {k} {a} remakes x_{i + 1} while alive")
            if a.kind == "fwd":
                opt = blk.options[a.option]
                made = x_bytes[i + 1] + opt.kept_bytes
                peak_bytes = max(peak_bytes, alive_bytes + blk.side_bytes + max(opt.fwd_peak_bytes, made))
                kept_option[i] = a.option
                time_ms += opt.fwd_ms
            else:
                made = x_bytes[i + 1]
                peak_bytes = max(peak_bytes, alive_bytes + blk.side_bytes + max(blk.none_fwd_peak_bytes, made))
                time_ms += blk.none_fwd_ms
            alive_bytes += made
            x_alive[i + 1] = True
        else:
            if kept_option.get(i) != a.option:
                raise InvalidScheduleError(f"chain replay: step {k} {a} needs the kept set of fwd option {a.option}")
            has_grad_out = x_alive[n] if i == n - 1 else delta_alive[i + 1]
            if not has_grad_out:
                raise InvalidScheduleError(f"chain replay: step {k} {a} reads δ_{i + 1}, which is not alive")
            opt = blk.options[a.option]
            made = blk.grad_input_bytes + blk.param_grad_bytes
            peak_bytes = max(peak_bytes, alive_bytes + blk.side_bytes + max(opt.bwd_peak_bytes, made))
            time_ms += opt.bwd_ms
            alive_bytes += made + blk.held_bytes - opt.kept_bytes
            del kept_option[i]
            delta_alive[i] = True
            if i < n - 1:
                delta_alive[i + 1] = False
                alive_bytes -= blocks[i + 1].grad_input_bytes
        for j in free_after[k]:
            if j > 0 and x_alive[j]:
                alive_bytes -= x_bytes[j]
            x_alive[j] = j == 0
    return peak_bytes, time_ms


# ---------------------------------------------------------------------------- slot sizes


@dataclass(frozen=True)
class _SlotChain:
    """All sizes of the chain in slots (each rounded up on its own), plus derived thresholds."""

    x: np.ndarray  # [n+1], x[0] = 0
    delta: np.ndarray  # [n+1], delta[n] = 0 (the loss x_n plays δ_n)
    pg_prefix: np.ndarray  # [n+1], sum of rounded param grads and held values of blocks < j
    none_eff: np.ndarray  # [n], transient of fwd_none
    none_ms: np.ndarray  # [n], fwd_none time per block
    kept: list[np.ndarray]  # per block, per option
    fwd_eff: list[np.ndarray]
    bwd_eff: list[np.ndarray]
    fb_ms: list[np.ndarray]  # fwd_ms + bwd_ms per option


def _slot_chain(blocks: Sequence[ChainBlock], budget_bytes: int, n_slots: int) -> _SlotChain:
    """Round every size up to slots of ``budget_bytes / n_slots`` (exactly, in integers)."""

    def up(size: int) -> int:
        if size <= 0:
            return 0
        if budget_bytes <= 0:
            return n_slots + 1
        return -(-int(size) * n_slots // int(budget_bytes))

    x = np.array([0] + [up(b.output_bytes) for b in blocks], dtype=np.int64)
    delta = np.array([up(b.grad_input_bytes) for b in blocks] + [0], dtype=np.int64)
    param_grads = [up(b.param_grad_bytes) for b in blocks]
    pg = [g + up(b.held_bytes) for g, b in zip(param_grads, blocks)]  # alive from each backward to the end
    side = [up(b.side_bytes) for b in blocks]
    kept, fwd_eff, bwd_eff, fb_ms = [], [], [], []
    for i, b in enumerate(blocks):
        k = np.array([up(o.kept_bytes) for o in b.options], dtype=np.int64)
        kept.append(k)
        fwd_eff.append(side[i] + np.maximum(np.array([up(o.fwd_peak_bytes) for o in b.options], dtype=np.int64),
                                            x[i + 1] + k))
        bwd_eff.append(side[i] + np.maximum(np.array([up(o.bwd_peak_bytes) for o in b.options], dtype=np.int64),
                                            delta[i] + param_grads[i]))
        fb_ms.append(np.array([o.fwd_ms + o.bwd_ms for o in b.options], dtype=np.float64))
    none_eff = np.array([side[i] + max(up(b.none_fwd_peak_bytes), int(x[i + 1])) for i, b in enumerate(blocks)],
                        dtype=np.int64)
    return _SlotChain(
        x=x, delta=delta, pg_prefix=np.concatenate([[0], np.cumsum(pg)]).astype(np.int64),
        none_eff=none_eff,
        none_ms=np.array([b.none_fwd_ms for b in blocks], dtype=np.float64),
        kept=kept, fwd_eff=fwd_eff, bwd_eff=bwd_eff, fb_ms=fb_ms)


def _option_thresholds(c: _SlotChain, n: int, s: int, t: int) -> np.ndarray:
    """Least free slots at the start of ``C(s, t, ·)`` for each option of case (1) to be valid locally."""
    if s == t:
        extra = c.x[n] if t == n - 1 else 0
    else:
        extra = c.delta[s + 1] - c.delta[t + 1] + c.pg_prefix[t + 1] - c.pg_prefix[s + 1]
    return np.maximum(c.fwd_eff[s], c.bwd_eff[s] + c.kept[s] + extra)


def _chain_none_peaks(c: _SlotChain, s: int, hi: int) -> np.ndarray:
    """Least free slots for running ``fwd_none`` on ``s..s'-1``, for ``s' = s+1..hi``."""
    steps = np.concatenate([[c.none_eff[s]], c.x[s + 1:hi] + c.none_eff[s + 1:hi]])
    return np.maximum.accumulate(steps)


# ---------------------------------------------------------------------------- DP


# NOTE [equal sub-chains]
#     ``C(s, t, ·)`` depends only on blocks ``s..t`` in slots (their sizes, options and times), on
#     ``δ_{t+1}``, and, where ``t`` is the last block, on the loss ``x_n``: every other quantity
#     it reads is a difference of prefix sums within ``s..t+1``.  A model's repeated layers make
#     the same blocks again and again, so most sub-chains equal one solved before; each is
#     given a key (equal keys, equal inputs) and solved once.  Times are summed from ``s`` (never as
#     differences of global prefix sums), so a reused row is bitwise the one it stands for.
def _subchain_keys(c: _SlotChain, n: int) -> np.ndarray:
    """``keys[s, t]``: equal for sub-chains ``s..t`` whose DP rows are equal (NOTE [equal sub-chains])."""
    block_ids: dict[tuple, int] = {}
    sig = [block_ids.setdefault(
        (c.fwd_eff[i].tobytes(), c.bwd_eff[i].tobytes(), c.kept[i].tobytes(), c.fb_ms[i].tobytes(), int(c.x[i + 1]),
         int(c.delta[i]), int(c.pg_prefix[i + 1] - c.pg_prefix[i]), int(c.none_eff[i]), float(c.none_ms[i])),
        len(block_ids)) for i in range(n)]
    ids: dict[tuple, int] = {}
    ends = [ids.setdefault(("end", int(c.delta[t + 1]), int(c.x[n]) if t == n - 1 else -1), len(ids)) for t in range(n)]
    keys = np.full((n, n), -1, dtype=np.int64)
    for s in range(n - 1, -1, -1):
        for t in range(s, n):
            rest = int(keys[s + 1, t]) if s < t else ends[t]
            keys[s, t] = ids.setdefault((sig[s], rest), len(ids))
    return keys


def _case1_at(c: _SlotChain, n: int, d_tables: np.ndarray, s: int, t: int, m: np.ndarray,
              reads: np.ndarray | None = None) -> np.ndarray:
    """Case (1) times, one row per option of block ``s``, at free-slot counts ``m`` (inf where it does not fit).

    ``reads``: the indices ``max(m - kept, 0)`` into ``C(s+1, t, ·)`` per option, when the caller has them (they
    depend on ``s`` only); clamped at 0 only where the threshold (≥ ``x_{s+1} + kept``) masks the result anyway.
    The tables and :func:`_choose` both come through here, so a reconstruction repeats the tables' float operations.
    """
    thresholds = _option_thresholds(c, n, s, t)
    if s < t:
        if reads is None:
            reads = np.maximum(m[None, :] - c.kept[s][:, None], 0)
        cand = d_tables[t, s + 1][reads]
        cand += c.fb_ms[s][:, None]
    else:
        cand = np.repeat(c.fb_ms[s][:, None], len(m), axis=1)
    cand[m[None, :] < thresholds[:, None]] = _INF
    return cand


def _none_penalty(c: _SlotChain, s: int, n: int, m: np.ndarray) -> np.ndarray:
    """Case (2)'s recompute time of ``s..s'-1`` where the ``fwd_none`` chain fits in ``m``, else inf.

    One row per ``s' = s+1..n-1``; independent of ``t``, so built once per ``s``.
    """
    peaks = _chain_none_peaks(c, s, n)[:n - 1 - s]
    recompute_ms = np.cumsum(c.none_ms[s:n - 1])  # summed from s, so equal sub-chains get equal sums
    return np.where(m[None, :] >= peaks[:, None], recompute_ms[:, None], _INF)


def _solve_tables(c: _SlotChain, n: int, m_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Fill the rk-Rotor tables; return ``(C(0, n-1, ·), D)`` with ``D[t, s', m] = C(s', t, m - x_{s'})``.

    No argmin is stored: :func:`_reconstruct` re-evaluates the few states it visits from ``D``.
    """
    width = m_slots + 1
    m_range = np.arange(width)
    w_lo, w_range = _case2_shift_range(c, m_slots)
    d_tables = np.empty((n, n, width))
    root = np.full(width, _INF)
    # E_s[s'][w] reads C(s, s'-1, ·) at w + pg(<s') - δ_{s'}: index 0 of [inf, C...] below 0, C(M) above M
    e_gather = [np.clip(w_range + c.pg_prefix[j] - c.delta[j] + 1, 0, width) for j in range(n)]
    keys = _subchain_keys(c, n).tolist()
    # C(s, t, ·) per sub-chain key (NOTE [equal sub-chains]), and the same behind one inf (E's gather reads it)
    solved: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for s in range(n - 1, -1, -1):
        e_tables = np.empty((n, len(w_range)))  # [s', w] = C(s, s'-1, w + pg(<s') - δ_{s'})
        penalty = None
        reads = None  # case (1)'s read of C(s+1, t, ·) per option: m - kept, at 0 where the threshold masks it
        x_s = int(c.x[s])
        for t in range(s, n):
            found = solved.get(keys[s][t])
            if found is None:
                if reads is None and s < t:
                    reads = np.maximum(m_range[None, :] - c.kept[s][:, None], 0)
                best = _case1_at(c, n, d_tables, s, t, m_range, reads).min(axis=0)
                if s < t:
                    if penalty is None:
                        penalty = _none_penalty(c, s, n, m_range)
                    off = int(c.delta[t + 1] - c.pg_prefix[t + 1]) - w_lo
                    cand2 = d_tables[t, s + 1:t + 1] + e_tables[s + 1:t + 1, off:off + width]
                    cand2 += penalty[:t - s]
                    best = np.minimum(best, cand2.min(axis=0))
                found = solved[keys[s][t]] = (best, np.concatenate([[_INF], best]))
            best, behind_inf = found
            d_tables[t, s, :min(x_s, width)] = _INF
            d_tables[t, s, x_s:] = best[:max(width - x_s, 0)]
            if t + 1 < n:
                e_tables[t + 1] = behind_inf[e_gather[t + 1]]
            if s == 0 and t == n - 1:
                root = best
    return root, d_tables


def _case2_shift_range(c: _SlotChain, m_slots: int) -> tuple[int, np.ndarray]:
    """Range of ``w = m + δ_{t+1} - pg(<t+1)`` over all ``m`` and ``t``: the index set of ``E_s``."""
    shift_t = c.delta[1:] - c.pg_prefix[1:]
    w_lo, w_hi = int(min(shift_t.min(), 0)), m_slots + int(max(shift_t.max(), 0))
    return w_lo, np.arange(w_lo, w_hi + 1)


def _table(d_tables: np.ndarray, c: _SlotChain, s: int, t: int, m: int) -> float:
    """``C(s, t, m)`` read back from ``D``; valid for states with ``x_s`` alive (``m ≤ M - x_s``)."""
    assert m + c.x[s] < d_tables.shape[2], f"chain DP: state C({s}, {t}, {m}) is not reachable"
    return float(d_tables[t, s, m + c.x[s]]) if m >= 0 else _INF


def _choose(c: _SlotChain, n: int, d_tables: np.ndarray, s: int, t: int, m: int) -> tuple[int, int]:
    """The DP's choice at a state, recomputed with the same float operations: (case, option or s')."""
    m_arr = np.array([m])
    cand1 = _case1_at(c, n, d_tables, s, t, m_arr)[:, 0]
    best1 = float(cand1.min())
    if s < t:
        m_slots = d_tables.shape[2] - 1
        s_ckpt = np.arange(s + 1, t + 1)
        m_back = m + c.delta[t + 1] - c.pg_prefix[t + 1] + c.pg_prefix[s_ckpt] - c.delta[s_ckpt]
        back = np.array([_INF if mb < 0 else _table(d_tables, c, s, int(sc) - 1, min(int(mb), m_slots))
                         for sc, mb in zip(s_ckpt, m_back)])
        cand2 = d_tables[t, s + 1:t + 1, m] + back
        cand2 += _none_penalty(c, s, n, m_arr)[:t - s, 0]
        if float(cand2.min()) < best1:
            return 2, s + 1 + int(np.argmin(cand2))
    assert np.isfinite(best1), f"chain DP: reconstruct reached infeasible state C({s}, {t}, {m})"
    return 1, int(np.argmin(cand1))


def _reconstruct(c: _SlotChain, n: int, m_slots: int, d_tables: np.ndarray) -> list[ChainAction]:
    """Turn the tables into actions with an explicit stack (no recursion limit at 100+ blocks)."""
    actions: list[ChainAction] = []
    stack: list[tuple[int, int, int] | ChainAction] = [(0, n - 1, m_slots)]
    while stack:
        item = stack.pop()
        if isinstance(item, ChainAction):
            actions.append(item)
            continue
        s, t, m = item
        case, pick = _choose(c, n, d_tables, s, t, m)
        if case == 1:
            actions.append(ChainAction("fwd", s, pick))
            stack.append(ChainAction("bwd", s, pick))
            if s < t:
                stack.append((s + 1, t, m - int(c.x[s + 1] + c.kept[s][pick])))
        else:
            actions.extend(ChainAction("fwd_none", j) for j in range(s, pick))
            m_back = m + int(c.delta[t + 1] - c.delta[pick] - c.pg_prefix[t + 1] + c.pg_prefix[pick])
            stack.append((s, pick - 1, min(m_back, m_slots)))
            stack.append((pick, t, m - int(c.x[pick])))
    return actions


def _always_made_slots(c: _SlotChain) -> int:
    """Largest single value every schedule must hold; above the budget nothing fits."""
    return int(max(c.x.max(), c.delta.max(), c.pg_prefix[-1]))


def solve_chain(blocks: Sequence[ChainBlock], budget_bytes: int, n_slots: int = 500) -> ChainPlan | None:
    """Fastest rk-Rotor schedule whose replayed peak stays within ``budget_bytes``; None if none fits.

    Memory is split into ``n_slots`` slots of ``budget_bytes / n_slots`` bytes; sizes round up,
    so the returned plan always fits, at the price of missing plans within a slot or so per
    live value of the budget.
    """
    n = len(blocks)
    if n == 0:
        return ChainPlan((), 0.0, 0)
    if any(not b.options for b in blocks):
        raise ValueError("chain DP: every block needs at least one option (its backward needs a kept set)")
    c = _slot_chain(blocks, budget_bytes, n_slots)
    if _always_made_slots(c) > n_slots:
        return None
    root, d_tables = _solve_tables(c, n, n_slots)
    if not np.isfinite(root[n_slots]):
        return None
    actions = _reconstruct(c, n, n_slots, d_tables)
    peak_bytes, time_ms = replay(blocks, actions)
    logger.debug("chain DP: %d blocks, budget %d B in %d slots: %.3f ms, peak %d B, %d actions",
                 n, budget_bytes, n_slots, time_ms, peak_bytes, len(actions))
    assert peak_bytes <= budget_bytes, f"chain DP: replayed peak {peak_bytes} B exceeds budget {budget_bytes} B"
    assert abs(time_ms - root[n_slots]) <= 1e-6 * max(1.0, time_ms), (
        f"chain DP: replayed time {time_ms} ms differs from the table's {root[n_slots]} ms")
    return ChainPlan(tuple(actions), time_ms, peak_bytes)


# ---------------------------------------------------------------------------- least budget


def _min_peak_slots(c: _SlotChain, n: int) -> int:
    """Least free memory (in the chain's units) for which ``C(0, n-1, ·)`` is finite.

    The same recurrence as the DP with ``max`` for ``+`` and ``min`` over choices: a feasible
    budget exists for ``C(s, t, m)`` exactly when ``m ≥ P(s, t)``.
    """
    p = np.zeros((n, n), dtype=np.int64)
    keys = _subchain_keys(c, n)
    solved: dict[int, int] = {}  # P(s, t) per sub-chain key (NOTE [equal sub-chains])
    for s in range(n - 1, -1, -1):
        none_peaks = _chain_none_peaks(c, s, n)
        for t in range(s, n):
            if int(keys[s, t]) in solved:
                p[s, t] = solved[int(keys[s, t])]
                continue
            need = _option_thresholds(c, n, s, t)
            if s < t:
                need = np.maximum(need, c.x[s + 1] + c.kept[s] + p[s + 1, t])
            best = int(need.min())
            if s < t:
                s_ckpt = np.arange(s + 1, t + 1)
                shift = c.delta[t + 1] - c.pg_prefix[t + 1] + c.pg_prefix[s_ckpt] - c.delta[s_ckpt]
                need2 = np.maximum(np.maximum(none_peaks[:t - s], c.x[s_ckpt] + p[s_ckpt, t]),
                                   p[s, s_ckpt - 1] - shift)
                best = min(best, int(need2.min()))
            p[s, t] = solved[int(keys[s, t])] = best
    return int(max(p[0, n - 1], _always_made_slots(c)))


def _dp_fits(blocks: Sequence[ChainBlock], budget_bytes: int, n_slots: int) -> bool:
    """Whether ``solve_chain(blocks, budget_bytes, n_slots)`` returns a plan, without building it."""
    return _min_peak_slots(_slot_chain(blocks, budget_bytes, n_slots), len(blocks)) <= n_slots


def min_feasible_budget(blocks: Sequence[ChainBlock], n_slots: int = 500, tolerance: float = 1 / 1024) -> int:
    """A budget in bytes for which :func:`solve_chain` finds a plan, at most ``tolerance`` above the smallest.

    Feasibility is monotone in the budget (slot sizes only shrink as it grows), so an exact
    byte-level lower bound followed by a galloping then binary search finds it.  The search stops
    within ``tolerance`` (the callers turn this budget by 1% steps; to the byte took twice the DP runs).
    """
    n = len(blocks)
    if n == 0:
        return 0
    lower = _min_peak_slots(_slot_chain(blocks, 1, 1), n)  # slots of one byte: exact bytes
    if _dp_fits(blocks, lower, n_slots):
        return lower
    step = max(1, lower // n_slots)
    while not _dp_fits(blocks, lower + step, n_slots):
        lower, step = lower + step, step * 2
    upper = lower + step  # fits; lower does not
    while upper - lower > max(1, int(upper * tolerance)):
        mid = (lower + upper) // 2
        lower, upper = (lower, mid) if _dp_fits(blocks, mid, n_slots) else (mid, upper)
    return upper
