"""make_blocks on hand-built problems: cut points, chain values, backward grouping and block keys."""
from __future__ import annotations

import itertools

import pytest

from remat_plugin.ir.problem import Op, Problem, Value
from remat_plugin.planning.blocks import make_blocks

Spec = list[tuple[str, tuple[str, ...]]]  # forward ops in order: (name, forward values it reads)


def build(fwd: Spec, sizes: dict[str, int] | None = None, no_grad: set[str] | frozenset[str] = frozenset()) -> Problem:
    """Forward op ``n`` makes value ``n``; the backward mirrors it.

    A synthetic ``tangents`` op starts the backward (as in a captured joint graph).  For every
    forward op ``n`` outside ``no_grad``, in reverse order, ``bwd_n`` reads ``n``'s inputs and the
    gradients of ``n``'s consumers (``tangents`` for the model output, the last op) and makes
    value ``bwd_n`` of ``n``'s size.  Graph inputs and parameters are placeholders: they appear in
    no op's inputs.  Ops whose names end in ``__rng`` are unrecomputable RNG captures.
    """
    sizes = sizes or {}
    size = {n: sizes.get(n, 10) for n, _ in fwd}
    ops = [Op(n, True, ins, (n,), 1.0, recomputable=not n.endswith("__rng")) for n, ins in fwd]
    values = [Value(n, size[n], n) for n, _ in fwd]
    consumers: dict[str, list[str]] = {n: [] for n, _ in fwd}
    for n, ins in fwd:
        for v in ins:
            consumers[v].append(n)
    output = fwd[-1][0]
    ops.append(Op("tangents", False, (), ("tangents",), 0.0))
    values.append(Value("tangents", size[output], "tangents"))
    for n, ins in reversed(fwd):
        if n in no_grad:
            continue
        grads = tuple(f"bwd_{c}" for c in consumers[n]) or ("tangents",)
        ops.append(Op(f"bwd_{n}", False, ins + grads, (f"bwd_{n}",), 2.0))
        values.append(Value(f"bwd_{n}", size[n], f"bwd_{n}"))
    return Problem(tuple(ops), tuple(values), frozenset({output}))


def chain(n: int) -> Spec:
    """f_0 -> f_1 -> ... -> f_{n-1}, one op per layer."""
    return [(f"f_{i}", (f"f_{i - 1}",) if i else ()) for i in range(n)]


def layers(n: int) -> Spec:
    """Linear+ReLU layers: mm_i reads relu_{i-1} (the weight is a placeholder), relu_i reads mm_i."""
    spec: Spec = []
    for i in range(n):
        spec.append((f"mm_{i}", (f"relu_{i - 1}",) if i else ()))
        spec.append((f"relu_{i}", (f"mm_{i}",)))
    return spec


# add_3 reads f_2 and f_0: f_0 crosses the positions of f_1 and f_2, so neither is a 1-separator.
SKIP: Spec = [
    ("f_0", ()), ("f_1", ("f_0",)), ("f_2", ("f_1",)), ("add_3", ("f_2", "f_0")), ("f_4", ("add_3",)),
    ("f_5", ("f_4",)),
]
# mask depends on no input (an arange/attention mask) and every layer reads it.
MASK: Spec = [("mask", ()), *((f"f_{i}", ((f"f_{i - 1}",) if i else ()) + ("mask",)) for i in range(4))]
# drop_1__rng captures the generator state just before the random op drop_1 (NOTE [random ops]).
RNG: Spec = [("f_0", ()), ("drop_1__rng", ()), ("drop_1", ("f_0", "drop_1__rng")), ("f_2", ("drop_1",))]

# (forward spec, constants, min_fwd_ops, expected blocks as (forward ops, input_value, output_value))
CUT_CASES = {
    # one op per layer, min 1: every position i carries exactly {f_i} to the next op -> cut everywhere
    "chain4_min1": (chain(4), set(), 1, [
        (("f_0",), None, "f_0"), (("f_1",), "f_0", "f_1"), (("f_2",), "f_1", "f_2"), (("f_3",), "f_2", None)]),
    # Linear+ReLU layers, min 2: after mm_i only {mm_i} crosses too, but a cut there would leave a
    # 1-op block; the cuts land after each relu_i (positions 1, 3), i.e. between layers
    "layers3_min2": (layers(3), set(), 2, [
        (("mm_0", "relu_0"), None, "relu_0"),
        (("mm_1", "relu_1"), "relu_0", "relu_1"),
        (("mm_2", "relu_2"), "relu_1", None)]),
    # crossing sets: 0:{f_0} 1:{f_0,f_1} 2:{f_0,f_2} 3:{add_3} 4:{f_4} -> cuts after 0, 3, 4
    "skip_min1": (SKIP, set(), 1, [
        (("f_0",), None, "f_0"), (("f_1", "f_2", "add_3"), "f_0", "add_3"), (("f_4",), "add_3", "f_4"),
        (("f_5",), "f_4", None)]),
    # min 2: position 0 is too early (1 op), 1-2 cross two values, 3 cuts, 4 is 1 op after 3; the
    # tail after 3 has 2 ops, enough to stay
    "skip_min2": (SKIP, set(), 2, [
        (("f_0", "f_1", "f_2", "add_3"), None, "add_3"), (("f_4", "f_5"), "add_3", None)]),
    # mask (position 0) is read by f_3 (position 4): it crosses every position 0..3, so with f_i
    # also crossing at 1..3 only position 0 ({mask}) qualifies, too early for min 2 -> one block
    "mask_glues_min2": (MASK, set(), 2, [(("mask", "f_0", "f_1", "f_2", "f_3"), None, None)]),
    # ... and with min 1 the only cut is right after the mask, with the mask as chain value
    "mask_glues_min1": (MASK, set(), 1, [
        (("mask",), None, "mask"), (("f_0", "f_1", "f_2", "f_3"), "mask", None)]),
    # as a constant the mask leaves the forward list (and every block): f_0..f_3 cut like a chain
    "mask_constant_min1": (MASK, {"mask"}, 1, [
        (("f_0",), None, "f_0"), (("f_1",), "f_0", "f_1"), (("f_2",), "f_1", "f_2"), (("f_3",), "f_2", None)]),
    "mask_constant_min2": (MASK, {"mask"}, 2, [
        (("f_0", "f_1"), None, "f_1"), (("f_2", "f_3"), "f_1", None)]),
    # position 0 carries only {f_0} but the next op (the RNG capture) is unrecomputable: no cut;
    # position 1 carries {f_0, drop_1__rng}; position 2 carries {drop_1} -> one cut, after drop_1
    "rng_capture_min1": (RNG, set(), 1, [
        (("f_0", "drop_1__rng", "drop_1"), None, "drop_1"), (("f_2",), "drop_1", None)]),
    # min_fwd_ops merge on a 5-op chain: min 2 cuts after 1 and 3, but the tail after 3 has 1 op
    # (< 2), so that cut is dropped and the tail joins the previous block
    "chain5_min2": (chain(5), set(), 2, [
        (("f_0", "f_1"), None, "f_1"), (("f_2", "f_3", "f_4"), "f_1", None)]),
    # min 3: cut after 2, tail of 2 ops (< 3) -> dropped, one block
    "chain5_min3": (chain(5), set(), 3, [(("f_0", "f_1", "f_2", "f_3", "f_4"), None, None)]),
    # min larger than the graph: never cut
    "chain5_min9": (chain(5), set(), 9, [(("f_0", "f_1", "f_2", "f_3", "f_4"), None, None)]),
    # a one-op graph is one block
    "single_op": (chain(1), set(), 2, [(("f_0",), None, None)]),
}


@pytest.mark.parametrize("name", CUT_CASES)
def test_cut_points(name: str) -> None:
    """Blocks' forward ops and chain values match the hand-derived 1-separators."""
    spec, constants, min_fwd_ops, expected = CUT_CASES[name]
    blocks = make_blocks(build(spec, no_grad={"mask", "drop_1__rng"}), constants, min_fwd_ops)
    assert [(b.fwd_ops, b.input_value, b.output_value) for b in blocks] == expected
    assert [b.index for b in blocks] == list(range(len(expected)))


# Backward grouping of 4 Linear+ReLU layers (cuts after each relu_i).  A backward op joins the
# earliest block among the forward values it reads and the groups of the backward values it reads:
#   bwd_relu_3 reads mm_3 (block 3), tangents                   -> 3
#   bwd_mm_3 reads relu_2 (block 2, the chain value), bwd_relu_3 -> 2   (so bwd_mm_i lands in i-1)
#   bwd_relu_2 reads mm_2 (2), bwd_mm_3 (2)                      -> 2   ... and so on down to
#   bwd_mm_0 reads only bwd_relu_0 (0)                           -> 0
#   tangents reads nothing: it joins its first reader's group    -> 3
LAYERS4_BWD = [
    ("bwd_mm_1", "bwd_relu_0", "bwd_mm_0"),
    ("bwd_mm_2", "bwd_relu_1"),
    ("bwd_mm_3", "bwd_relu_2"),
    ("tangents", "bwd_relu_3"),
]
# Block live_out: values made inside and read outside (gradient to the previous block), plus the
# model output; the chain value x_{k+1} is the chain's to keep and is excluded.
LAYERS4_LIVE = [frozenset(), {"bwd_relu_1"}, {"bwd_relu_2"}, {"relu_3", "bwd_relu_3"}]


def test_backward_grouping_and_block_problems() -> None:
    """Backward ops go to the earliest block they read from; block problems keep only inside inputs."""
    blocks = make_blocks(build(layers(4)), set())
    assert [b.bwd_ops for b in blocks] == LAYERS4_BWD
    assert [b.problem.live_out for b in blocks] == LAYERS4_LIVE
    b1 = blocks[1].problem
    assert [o.name for o in b1.ops] == ["mm_1", "relu_1", "bwd_mm_2", "bwd_relu_1"]
    # mm_1's input relu_0 and bwd_mm_2's gradient input bwd_relu_2 come from other blocks: dropped
    assert [o.inputs for o in b1.ops] == [(), ("mm_1",), ("relu_1",), ("mm_1", "bwd_mm_2")]
    assert {v.name for v in b1.values} == {"mm_1", "relu_1", "bwd_mm_2", "bwd_relu_1"}


# (spec, sizes, classes of block indices expected to share a key)
KEY_CASES = {
    # first block has the extra bwd_mm_0, last one tangents and the model output: only middles match
    "layers4": (layers(4), {}, [[0], [1, 2], [3]]),
    "layers5": (layers(5), {}, [[0], [1, 2, 3], [4]]),
    # layer 2 twice as big: block 2 differs, and so does block 1 (it holds bwd_mm_2, of mm_2's size)
    "layers4_layer2_bigger": (layers(4), {"mm_2": 20, "relu_2": 20}, [[0], [1], [2], [3]]),
    # the output relu_3 bigger (and so the tangent): block 3 changes, and so does block 2: it holds bwd_mm_3
    # (mm_3's size, as block 1's bwd_mm_2) but reads bwd_relu_3, relu_3's size, from block 3 (NOTE [incoming
    # gradients])
    "layers4_last_bigger": (layers(4), {"relu_3": 40}, [[0], [1], [2], [3]]),
}


@pytest.mark.parametrize("name", KEY_CASES)
def test_identical_blocks_share_key(name: str) -> None:
    """Blocks equal up to op numbering share ``key``; any size difference separates them."""
    spec, sizes, classes = KEY_CASES[name]
    blocks = make_blocks(build(spec, sizes), set())
    by_key: dict[tuple, list[int]] = {}
    for b in blocks:
        by_key.setdefault(b.key, []).append(b.index)
    assert sorted(by_key.values()) == classes


def _routed(n_layers: int) -> tuple[Spec, dict[str, int]]:
    """Layers of 20 ops (``a_i`` read again by the last, ``h_i``, the chain value) whose second op makes a small
    ``r_i`` (a router's logits) read at the end by ``aux`` (the load-balancing loss), after a 3-op tail."""
    spec: Spec = []
    sizes: dict[str, int] = {}
    prev: tuple[str, ...] = ()
    for i in range(n_layers):
        middle = [f"m{k}_{i}" for k in range(17)]
        spec += [(f"a_{i}", prev), (f"r_{i}", (f"a_{i}",)), (middle[0], (f"a_{i}", f"r_{i}"))]
        spec += [(c, (p,)) for p, c in itertools.pairwise(middle)]
        spec.append((f"h_{i}", (middle[-1], f"a_{i}")))
        sizes[f"r_{i}"] = 1
        prev = (f"h_{i}",)
    spec += [("t_1", prev), ("t_2", ("t_1",)), ("t_3", ("t_2",)), ("aux", ("t_3", *(f"r_{i}" for i in range(n_layers))))]
    return spec, sizes


def test_small_values_read_at_the_end_are_side_values_and_the_layers_own_are_not() -> None:
    """NOTE [side values]: a mixture-of-experts model keeps each layer's router logits for the loss at the end.
    Their lifetimes fall off evenly (102, 82, 62, 42, 22 ops here; 194, 147, 100, 53 in a 4-layer Mixtral), so the
    longest-lived rule cut its gap below the layers' own skips (``a_i``, 19 ops, the residual streams there), which
    became side values, stored and never recomputed (at other sizes it found no gap at all: one greedy block).
    Small long-lived values are a candidate set of their own, and the set with the fewest bytes is taken: the
    routers' logits alone; each ``a_i`` stays a chain value the plan can store or recompute."""
    spec, sizes = _routed(5)
    blocks = make_blocks(build(spec, sizes), set())
    assert [b.output_value for b in blocks] == [
        "a_0", "h_0", "a_1", "h_1", "a_2", "h_2", "a_3", "h_3", "a_4", "h_4", "t_2", None]
