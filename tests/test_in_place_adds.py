"""Adds into a dying operand (NOTE [in-place adds] in remat_plugin.capture.in_place_adds)."""
from __future__ import annotations

import operator

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from remat_plugin.bench.models import build
from remat_plugin.capture.in_place_adds import add_in_place, adds_functional
from remat_plugin.runtime.module import RematModule

aten = torch.ops.aten


def _graph(build_body) -> fx.GraphModule:
    """A graph of two inputs (4x8 float) whose body ``build_body(graph, x, y)`` returns the output nodes."""
    graph = fx.Graph()
    mode = FakeTensorMode()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    with mode:
        x.meta["val"], y.meta["val"] = torch.empty(4, 8), torch.empty(4, 8)
    graph.output(build_body(graph, x, y))
    with mode:  # each node's meta val, as the traced graphs carry them
        for n in graph.nodes:
            if n.op == "call_function":
                args = fx.node.map_arg(n.args, lambda a: a.meta["val"])
                n.meta["val"] = n.target(*args)
    return fx.GraphModule(torch.nn.Module(), graph)


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_an_operand_only_the_add_reads_takes_the_sum():
    def body(g, x, y):
        a = g.call_function(aten.mul.Tensor, (x, y))  # fresh, read by the add alone
        return (g.call_function(aten.add.Tensor, (y, a)),)
    gm = _graph(body)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    want = gm(x, y)[0]
    assert add_in_place(gm) == 1 and aten.add_.Tensor in _targets(gm)
    got = gm(x, y)[0]
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def test_operands_read_again_viewed_broadcast_or_inputs_stay_functional():
    def read_again(g, x, y):
        a = g.call_function(aten.mul.Tensor, (x, y))
        return g.call_function(aten.add.Tensor, (a, y)), a

    def a_view(g, x, y):
        a = g.call_function(aten.t.default, (g.call_function(aten.mul.Tensor, (x, y)),))
        return (g.call_function(aten.add.Tensor, (a, g.call_function(aten.t.default, (y,)))),)

    def broadcast(g, x, y):
        row = g.call_function(aten.sum.dim_IntList, (x, [0], True))  # 1x8, summed into 4x8
        return (g.call_function(aten.add.Tensor, (row, y)),)

    def inputs_only(g, x, y):
        return (g.call_function(aten.add.Tensor, (x, y)),)

    def same_twice(g, x, y):
        a = g.call_function(aten.mul.Tensor, (x, y))
        return (g.call_function(aten.add.Tensor, (a, a)),)

    def unsafe_view_of_a_kept_value(g, x, y):  # _unsafe_view declares no alias, yet shares the product's memory
        a = g.call_function(aten.mul.Tensor, (x, y))
        v = g.call_function(aten._unsafe_view.default, (a, [4, 8]))
        return g.call_function(aten.add.Tensor, (v, y)), a  # ``a`` kept (a plan that saves it for the backward)

    for body in (read_again, a_view, broadcast, inputs_only, same_twice, unsafe_view_of_a_kept_value):
        gm = _graph(body)
        assert add_in_place(gm) == 0, body.__name__
        assert aten.add_.Tensor not in _targets(gm), body.__name__


def test_an_unsafe_view_of_a_value_only_it_reads_takes_the_sum():
    def body(g, x, y):
        a = g.call_function(aten.mul.Tensor, (x, y))
        v = g.call_function(aten._unsafe_view.default, (a, [4, 8]))
        return (g.call_function(aten.add.Tensor, (v, y)),)
    gm = _graph(body)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    want = gm(x, y)[0]
    assert add_in_place(gm) == 1
    assert torch.equal(gm(x, y)[0], want)


def test_planned_gpt2_sums_gradients_in_place_with_eager_gradients():
    """float64, dropout on: the planned backward adds in place and its gradients are bitwise eager's."""
    bench = build("gpt2-tiny", dtype=torch.float64, n_layer=2)
    args, kwargs = bench.make_batch(0)

    def step(model):
        bench.module.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        bench.loss(model(*args, **kwargs)).backward()
        return [p.grad.clone() for p in bench.module.parameters()]

    step(bench.module)  # the first eager step of a process can round GELU's tanh otherwise (see README, Known limits)
    expected = step(bench.module)
    rm = RematModule(bench.module, budget=10**12, verbose=False)
    for _ in range(3):
        got = step(rm)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    backward = rm._resolver.latest.run.backward.gm  # the SegmentedBackward's program
    assert aten.add_.Tensor in _targets(backward), "the planned backward has no in-place add"
    with adds_functional():  # the benchmark's baseline: every add out of place, the same gradients
        functional = RematModule(bench.module, budget=10**12, verbose=False)
        for _ in range(2):
            got = step(functional)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert aten.add_.Tensor not in _targets(functional._resolver.latest.run.backward.gm)


class _Similarity(torch.nn.Module):
    """CLIP's contrastive loss: the similarity reaches the loss directly and transposed, and is returned beside
    the loss, whose caller drops it (NOTE [dropped tangents] folds its tangent)."""

    def __init__(self):
        super().__init__()
        self.text, self.image = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))

    def forward(self, x, y):
        similarity = self.text(x) @ self.image(y).t() * self.logit_scale.exp()
        labels = torch.arange(x.shape[0])
        loss = (torch.nn.functional.cross_entropy(similarity, labels)
                + torch.nn.functional.cross_entropy(similarity.t(), labels)) / 2
        return loss, similarity, similarity.t()


def test_a_sum_laid_out_otherwise_than_traced_stays_out_of_place():
    """The folded tangent's gradient runs transposed where the trace added a row-major tangent to it: written into
    the row-major operand, the logit scale's gradient was one unit in the last place off eager's in about half
    the steps.  Every step is bitwise eager's, the first too: the first plan adds the similarity's missing
    gradient as zeros laid out as the gradient they are added into (NOTE [relaid tangents]); they were laid out
    as the output, which made the sum row-major where eager's is the transposed gradient itself."""
    torch.manual_seed(0)
    model = _Similarity().double()
    reference = _Similarity().double()
    reference.load_state_dict(model.state_dict())
    batches = [(torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)) for _ in range(12)]
    rm = RematModule(model, budget=10**12, verbose=False)
    for i, batch in enumerate(batches):
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        rm(*batch)[0].backward()
        reference(*batch)[0].backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), (i, (p.grad - q.grad).abs().max())


class _TiedLM(torch.nn.Module):
    """A tied embedding much larger than a short batch's activations (GPT-2's head on a 16k vocabulary, 8 MiB in
    float64): the step peaks at the backward's end, where the embedding's two gradients are summed."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16384, 64)
        self.mix = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))

    def forward(self, ids):
        logits = self.mix(self.embed(ids)) @ self.embed.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _operand(node: fx.Node) -> str:
    """An operand by its op: the emitted backward names a multi-output op's outputs anew."""
    return f"{node.args[0].name}[{node.args[1]}]" if node.target is operator.getitem else node.name


@pytest.mark.parametrize("model", ["tied", "gpt2-tiny", "llama-tiny", "t5-tiny"])
def test_the_plan_counts_the_sums_the_backward_writes_in_place(monkeypatch, model):
    """NOTE [in-place sums in the plan]: every sum the plan counts as written into an operand is one the emitted
    backward writes in place; on the tied model, whose peak is that sum, the plan predicts the metered peak within a
    few bytes (it predicted one embedding gradient, 8 MiB, above it when every sum counted as new)."""
    from remat_plugin.capture import export
    from remat_plugin.capture.memory_meter import measure_peak_profiler

    planned: list[dict[str, str]] = []
    real = export.sums_in_place

    def spied(gm):
        sums = real(gm)
        nodes = {n.name: n for n in gm.graph.nodes}
        planned.append({add: _operand(nodes[into]) for add, into in sums.items()})
        return sums

    monkeypatch.setattr(export, "sums_in_place", spied)
    if model == "tied":
        torch.manual_seed(0)
        module = _TiedLM().double()
        args, kwargs, loss_of = (torch.randint(0, 16384, (2, 16)),), {}, lambda out: out
    else:
        bench = build(model, dtype=torch.float64, n_layer=2)
        module, (args, kwargs), loss_of = bench.module, bench.make_batch(0), bench.loss
    rm = RematModule(module, budget=10**12, verbose=False)

    def step():
        module.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss_of(rm(*args, **kwargs)).backward()

    for _ in range(3):  # settled: re-planned for the outputs the loss leaves
        step()
    backward = rm._resolver.latest.run.backward.gm
    written = {n.name: _operand(n.args[0]) for n in backward.graph.nodes if n.target is aten.add_.Tensor}
    assert planned[-1], "no sum planned in place"
    assert planned[-1].items() <= written.items(), (planned[-1], written)
    if model == "tied":
        module.zero_grad(set_to_none=True)
        _, peak = measure_peak_profiler(step)
        assert abs(peak - rm.plan.predicted_peak_bytes) <= 64, (peak, rm.plan.predicted_peak_bytes)  # the loss's 8 bytes


class _SegmentationHead(torch.nn.Module):
    """SegFormer's head: per-pixel logits over a channels-last feature map, resized to the labels for the loss and
    returned beside it, laid out as the features."""

    def __init__(self):
        super().__init__()
        self.mix = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.classifier = torch.nn.Conv2d(8, 4, 1)

    def forward(self, features, labels):
        logits = self.classifier(torch.relu(self.mix(features)))
        resized = torch.nn.functional.interpolate(logits, size=labels.shape[-2:], mode="bilinear")
        return torch.nn.functional.cross_entropy(resized, labels), logits


def test_a_held_output_s_missing_gradient_leaves_the_sum_laid_out_as_eager_s():
    """The caller holds the channels-last logits and sends them no gradient: eager passes the resize's row-major
    gradient on as it is, where the first plan added a zero tangent laid out as the logits, and the classifier's
    bias gradient summed in another order (NOTE [relaid tangents]).  Every step is bitwise eager's."""
    torch.manual_seed(0)
    model = _SegmentationHead().double()
    reference = _SegmentationHead().double()
    reference.load_state_dict(model.state_dict())
    rm = RematModule(model, budget=10**12, verbose=False)
    for i in range(3):
        features = torch.randn(2, 8, 16, 16, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
        labels = torch.randint(0, 4, (2, 32, 32))
        for m in (model, reference):
            m.zero_grad(set_to_none=True)
        loss, logits = rm(features, labels)
        loss.backward()
        assert logits.is_contiguous(memory_format=torch.channels_last)
        reference(features, labels)[0].backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), (i, name, (p.grad - q.grad).abs().max())
