"""Adds into a dying operand (NOTE [in-place adds] in remat_plugin.capture.in_place_adds)."""
from __future__ import annotations

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
    the steps.  From the second step (the first plan keeps autograd's zero gradients for the outputs, as
    torch.compile does; README "Known limits") every step is bitwise eager's."""
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
        if i > 0:
            for p, q in zip(model.parameters(), reference.parameters()):
                assert torch.equal(p.grad, q.grad), (i, (p.grad - q.grad).abs().max())
