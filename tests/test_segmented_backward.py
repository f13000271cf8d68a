"""The planned backward releases parameter gradients as it goes (NOTE [segmented backward]).

Each test compares against the unmodified model in float64 with dropout on (same seed): gradients
bitwise equal.  Hook timing is read with a dispatch mode counting the backward's aten ops, so
"the last layer's gradients were ready before the first layer's backward ran" is measured, not assumed.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat_plugin import CallsInFlightError
from remat_plugin.bench.models import build
from remat_plugin.capture.segments import SegmentedBackward
from remat_plugin.runtime.module import RematModule


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _model(name="gpt2-tiny", **kw):
    bench = build(name, dtype=torch.float64, **kw)
    args, kwargs = bench.make_batch(0)
    return bench, args, kwargs


def _rematted(bench, args, kwargs, share=0.5, **options):
    plain = RematModule(bench.module, budget=10**12, verbose=False)
    plain(*args, **kwargs)
    peak = plain._resolver.current_plan.baseline_peak_bytes
    return RematModule(bench.module, budget=int(peak * share), verbose=False, **options)


def _step(bench, model, args, kwargs, seed=1):
    """Gradients of one step and, per parameter name, how many backward ops had run when its hook fired."""
    for p in bench.module.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = bench.loss(model(*args, **kwargs))
    counter = _OpCount()
    fired: dict[str, int] = {}

    def hook(name):
        return lambda _p: fired.setdefault(name, counter.n) and None

    hooks = [p.register_post_accumulate_grad_hook(hook(n)) for n, p in bench.module.named_parameters()]
    with counter:
        loss.backward()
    for h in hooks:
        h.remove()
    return {n: p.grad.clone() for n, p in bench.module.named_parameters() if p.grad is not None}, fired, counter.n


def _eager_grads(bench, args, kwargs):
    return _step(bench, bench.module, args, kwargs)[0]


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n


@pytest.mark.parametrize("name, last, first", [
    ("gpt2-tiny", "transformer.h.3.", "transformer.h.0."),
    ("llama-tiny", "model.layers.3.", "model.layers.0."),
])
def test_last_layers_gradients_ready_before_first_layers_backward(name, last, first):
    bench, args, kwargs = _model(name)
    expected = _eager_grads(bench, args, kwargs)
    rm = _rematted(bench, args, kwargs)
    for _ in range(3):  # the first call traces (one node); later calls release gradients segment by segment
        grads, fired, total = _step(bench, rm, args, kwargs)
        _assert_same(grads, expected)
    assert isinstance(rm._resolver.latest.run.backward, SegmentedBackward)
    last_ready = max(c for n, c in fired.items() if n.startswith(last))
    first_ready = min(c for n, c in fired.items() if n.startswith(first))
    assert last_ready < 0.5 * total, (last_ready, total)  # the last layer's hooks fired in the first half
    assert last_ready < first_ready  # ... before any of the first layer's
    assert rm._resolver.current_plan.predicted_peak_bytes <= rm._resolver.current_plan.budget_bytes


def test_one_segment_releases_every_gradient_at_the_end():
    """``backward_segments=1``: today's single node, every hook after the last backward op (the test above can fail)."""
    bench, args, kwargs = _model()
    expected = _eager_grads(bench, args, kwargs)
    rm = _rematted(bench, args, kwargs, backward_segments=1)
    for _ in range(2):
        grads, fired, total = _step(bench, rm, args, kwargs)
    _assert_same(grads, expected)
    # after the first hook only AccumulateGrad's own ops run: at most one per parameter
    assert min(fired.values()) >= total - len(fired), (min(fired.values()), total, len(fired))


def test_autograd_grad_retain_graph_and_interleaved_calls():
    """``torch.autograd.grad`` (no ``.grad`` touched), two backwards through one graph, two calls before one backward."""
    bench, args, kwargs = _model(n_layer=3)
    params = list(bench.module.parameters())
    torch.manual_seed(1)
    expected = torch.autograd.grad(bench.loss(bench.module(*args, **kwargs)), params)
    rm = _rematted(bench, args, kwargs)
    _step(bench, rm, args, kwargs)  # traces
    for p in params:
        p.grad = None
    torch.manual_seed(1)
    got = torch.autograd.grad(bench.loss(rm(*args, **kwargs)), params)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(p.grad is None for p in params)

    torch.manual_seed(1)
    loss = bench.loss(rm(*args, **kwargs))
    loss.backward(retain_graph=True)
    loss.backward()
    assert all(torch.equal(p.grad, 2 * e) for p, e in zip(params, expected))

    args2, kwargs2 = bench.make_batch(1)
    for p in params:
        p.grad = None
    torch.manual_seed(1)
    eager = bench.loss(bench.module(*args, **kwargs)) + bench.loss(bench.module(*args2, **kwargs2))
    want = torch.autograd.grad(eager, params)
    torch.manual_seed(1)
    first = bench.loss(rm(*args, **kwargs))
    with pytest.raises(CallsInFlightError):  # beside the first call's saved tensors, over the budget
        rm(*args2, **kwargs2)
    del first
    both_fit = _rematted(bench, args, kwargs, share=2.2)  # a budget that holds both calls (NOTE [calls in flight])
    torch.manual_seed(1)
    both = bench.loss(both_fit(*args, **kwargs)) + bench.loss(both_fit(*args2, **kwargs2))
    both.backward()
    assert all(torch.allclose(p.grad, w, rtol=0, atol=1e-12) for p, w in zip(params, want))


def test_frozen_parameters_and_input_gradients():
    """Parameters frozen after planning get no gradient; an input that needs one gets it from the last segment."""
    bench, _, kwargs = _model(n_layer=3)
    module = bench.module
    embeds = module.transformer.wte(kwargs["input_ids"]).detach().requires_grad_()
    kw = {"inputs_embeds": embeds, "labels": kwargs["labels"]}
    frozen = list(module.transformer.h[2].parameters())
    rm = _rematted(bench, (), kw)
    _step(bench, rm, (), kw)  # traces with every parameter trainable
    for p in frozen:
        p.requires_grad_(False)
    try:
        torch.manual_seed(1)
        ref = torch.autograd.grad(bench.loss(module(**kw)), [embeds, *module.transformer.h[0].parameters()])
        for p in module.parameters():
            p.grad = None
        embeds.grad = None
        torch.manual_seed(1)
        bench.loss(rm(**kw)).backward()
        assert all(p.grad is None for p in frozen)
        assert torch.equal(embeds.grad, ref[0])
        assert all(torch.equal(p.grad, r) for p, r in zip(module.transformer.h[0].parameters(), ref[1:]))
    finally:
        for p in frozen:
            p.requires_grad_(True)


def test_unused_parameter_keeps_no_gradient():
    """A parameter the step never reads (registered first, so it leads segment 0's inputs) keeps ``.grad`` None."""
    bench, args, kwargs = _model(n_layer=3)
    unused = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    bench.module.transformer.register_parameter("unused", unused)
    expected = _eager_grads(bench, args, kwargs)
    assert unused.grad is None
    rm = _rematted(bench, args, kwargs)
    for _ in range(3):
        grads, _fired, _total = _step(bench, rm, args, kwargs)
        assert unused.grad is None
        _assert_same(grads, expected)
    assert rm._resolver.latest.run.backward.n_segments > 1


def test_backward_segments_option():
    """``REMAT_BACKWARD_SEGMENTS`` / ``backward_segments``: read, checked, and what the session's steps run."""
    from remat_plugin.runtime.config import ConfigError, RematConfig

    assert RematConfig.from_env({"REMAT_BACKWARD_SEGMENTS": "1"}).backward_segments == 1
    assert RematConfig().backward_segments == 8
    with pytest.raises(ConfigError, match="REMAT_BACKWARD_SEGMENTS"):
        RematConfig.from_env({"REMAT_BACKWARD_SEGMENTS": "0"})
    with pytest.raises(ConfigError, match="backward_segments"):
        RematConfig(backward_segments=0)


class _SideBranch(torch.nn.Module):
    """GPT-2's body with a side output branching off its embeddings, which the loss below leaves out."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm
        self.side = torch.nn.Linear(lm.config.n_embd, lm.config.n_embd, dtype=torch.float64)

    def forward(self, input_ids):
        embedded = self.lm.wte(input_ids)
        return self.lm(inputs_embeds=embedded, use_cache=False).last_hidden_state, torch.tanh(self.side(embedded))


def test_a_later_segments_gradient_no_tangent_reaches_stays_none():
    """NOTE [gradients no tangent reaches] in a backward released in segments (the side Linear's gradient is
    made in the first, with the anchor's): it stays None at every step, as eager leaves it, the others bitwise
    eager's."""
    import copy

    bench, args, kwargs = _model()
    model = _SideBranch(bench.module.transformer)
    reference = copy.deepcopy(model)
    ids = kwargs["input_ids"]
    rm = RematModule(model, budget=10**12, verbose=False, backward_segments=8)
    for step in range(4):
        grads = []
        for m in (rm, reference):
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            m(ids)[0].pow(2).mean().backward()
            grads.append({n: p.grad for n, p in (model if m is rm else reference).named_parameters()})
        assert grads[0]["side.weight"] is None and grads[1]["side.weight"] is None, step
        _assert_same({n: g for n, g in grads[0].items() if g is not None},
                     {n: g for n, g in grads[1].items() if g is not None})
    backward = rm._resolver.latest.run.backward
    assert isinstance(backward, SegmentedBackward) and backward.n_segments > 1
