"""Repeated layers traced once and spliced (NOTE [layers traced once] in capture/repeated_layers.py).

The spliced joint graph must be the one a whole-model trace gives, node for node; a model whose layers
cannot be spliced is traced whole and says so.
"""
import logging
import threading

import pytest
import torch
from budgets import assert_bitwise_at_a_recomputing_budget
from torch import fx, nn

from remat_plugin import rematerialize
from remat_plugin.bench.models import build
from remat_plugin.capture.export import LAYERS_META, ExecutionOptions, build_step
from remat_plugin.capture.joint import is_view_target
from remat_plugin.capture.repeated_layers import RepeatedLayers, _running_own_forward
from remat_plugin.runtime.config import ConfigError, RematConfig


class _Emitted(Exception):
    pass


def _joint(module, args, kwargs, once: bool):
    """The joint graph planning receives, and the step's exported module."""
    got = {}

    def emit(joint):
        got["joint"] = joint
        raise _Emitted

    step = build_step(module, args, kwargs, emit, torch.device("cpu"), options=ExecutionOptions(layers_once=once))
    with pytest.raises(_Emitted):
        step(args, kwargs)
    return got["joint"], step.exported


def _canonical(gm: fx.GraphModule) -> list[tuple]:
    """Each node as (op, target, arguments by position of the nodes they read, forward or backward, its value's
    size, strides and type, and for an op that makes storage, the first node whose value shares it): names aside.
    Inductor reads aliasing from the values' fake storages (a view's own fake storage varies with where AOTAutograd
    traced its operand: a graph input or not)."""
    index: dict[fx.Node, int] = {}
    first_on: dict[int, int] = {}
    out = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        by_position = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a]}")
        vals = n.meta.get("val")
        metas = []
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if isinstance(v, torch.Tensor):
                storage = None if is_view_target(n.target) else first_on.setdefault(v.untyped_storage()._cdata, i)
                metas.append((tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, storage))
        out.append((n.op, "" if n.op == "placeholder" else str(n.target), repr(by_position),
                    n.meta.get("partitioner_tag"), tuple(metas)))
    return out


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny", "bert-tiny"])
def test_spliced_joint_graph_is_the_whole_models_trace(name):
    """float64, dropout on, padding masks: every layer spliced from one traced layer gives the very joint graph of
    tracing every layer, in the same order (the model-family tests check these models' gradients against eager)."""
    bench = build(name, dtype=torch.float64)
    args, kwargs = bench.make_batch(0)
    whole, whole_exported = _joint(bench.module, args, kwargs, once=False)
    spliced, exported = _joint(bench.module, args, kwargs, once=True)
    layers = exported.meta[LAYERS_META]
    assert LAYERS_META not in whole_exported.meta
    assert len(layers.layers) >= 2 and len(layers.templates) == 1  # identical layers: one traced
    assert _canonical(spliced.gm) == _canonical(whole.gm)
    assert not [n for n in spliced.gm.graph.nodes if "remat_plugin.layer" in str(n.target)]


@pytest.mark.parametrize("name", ["llama-tiny", "gpt2-tiny"])
def test_spliced_joint_graph_under_bf16_autocast_is_the_whole_models_trace(name):
    """Captured inside ``torch.autocast``: the templates are traced under the caller's autocast, so their casts are
    the whole-model trace's (AOTAutograd itself partitions with autocast off)."""
    bench = build(name)
    args, kwargs = bench.make_batch(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole, _ = _joint(bench.module, args, kwargs, once=False)
        spliced, exported = _joint(bench.module, args, kwargs, once=True)
    assert LAYERS_META in exported.meta
    assert any(n.target is torch.ops.aten._to_copy.default for n in spliced.gm.graph.nodes)
    assert _canonical(spliced.gm) == _canonical(whole.gm)


class _AutocastOffForOneLayer(nn.Module):
    """Layer 2 runs with autocast off (as fp32 islands do): its fingerprint and template must be traced that way."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == 2:
                with torch.autocast("cpu", enabled=False):
                    x = torch.relu(layer(x.float()))
            else:
                x = torch.relu(layer(x))
        return x.float().square().mean()


def test_a_layer_called_where_the_model_turns_autocast_off_is_traced_so():
    torch.manual_seed(0)
    model, x = _AutocastOffForOneLayer(), torch.randn(128, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole, _ = _joint(model, (x,), {}, once=False)
        spliced, exported = _joint(model, (x,), {}, once=True)
    assert len(exported.meta[LAYERS_META].templates) >= 2  # the fp32 call is a kind of its own
    assert _canonical(spliced.gm) == _canonical(whole.gm)


class _ScaledLayer(nn.Module):
    """A layer whose forward depends on more than its parameters' shapes: a per-layer scale and, on odd layers, a
    different activation."""

    def __init__(self, index: int):
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.scale = 1.0 / (index + 1)
        self.odd = index % 2 == 1
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        y = self.linear(x) * self.scale
        y = torch.tanh(y) if self.odd else torch.relu(y)
        return x + self.drop(y)


class _Stack(nn.Module):
    def __init__(self, layers: list[nn.Module], memory: bool = False):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.layers = nn.ModuleList(layers)
        self.memory = memory
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h = self.inp(x)
        mem = h * 2
        for layer in self.layers:
            h = layer(h, mem) if self.memory else layer(h)
        return self.out(h).square().mean()


def test_layers_that_differ_beyond_their_shapes_get_templates_of_their_own():
    """Fingerprints tell per-layer constants apart (scales 1, 1/2, 1/3, 1/4; relu or tanh): four templates for
    four layers, the joint graph still the whole trace's, the gradients exact."""
    torch.manual_seed(0)
    model = _Stack([_ScaledLayer(i) for i in range(4)]).double().train()
    x = torch.randn(2048, 16, dtype=torch.float64)
    whole, _ = _joint(model, (x,), {}, once=False)
    spliced, exported = _joint(model, (x,), {}, once=True)
    assert len(exported.meta[LAYERS_META].templates) == 4
    assert _canonical(spliced.gm) == _canonical(whole.gm)
    reference = _Stack([_ScaledLayer(i) for i in range(4)]).double().train()
    reference.load_state_dict(model.state_dict())
    _assert_exact(model, reference, x)


def test_a_layer_forward_running_on_another_thread_leaves_this_threads_layers_opaque():
    """Whether a layer's own forward is running (a fingerprint, a template's export) is per thread: a model captured
    while another thread is inside one still has its layers traced once, four calls of one template."""
    started, release = threading.Event(), threading.Event()

    def inside_a_layer_forward():
        with _running_own_forward():
            started.set()
            release.wait(60)

    other = threading.Thread(target=inside_a_layer_forward)
    other.start()
    try:
        assert started.wait(60)
        torch.manual_seed(0)
        model = _Stack([_ScaledLayer(0) for _ in range(4)]).double().train()
        _, exported = _joint(model, (torch.randn(64, 16, dtype=torch.float64),), {}, once=True)
    finally:
        release.set()
        other.join()
    layers = exported.meta[LAYERS_META]
    assert len(layers.calls) == 4 and len(layers.templates) == 1


class _ReadsMemory(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)

    def forward(self, x, mem):
        return x + torch.relu(self.a(x)) * self.b(mem)


def test_a_value_every_layer_differentiates_is_traced_whole_with_a_warning(caplog):
    """An encoder-output-like value read by every layer: its gradients would be summed in another order, so the
    model is traced whole (said once), and its step is exact."""
    torch.manual_seed(0)
    model = _Stack([_ReadsMemory() for _ in range(3)], memory=True).double().train()
    reference = _Stack([_ReadsMemory() for _ in range(3)], memory=True).double().train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2048, 16, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        whole, _ = _joint(model, (x,), {}, once=False)
        spliced, exported = _joint(model, (x,), {}, once=True)
    assert _canonical(spliced.gm) == _canonical(whole.gm)
    assert LAYERS_META not in exported.meta
    assert any("could not be traced once" in r.getMessage() and "is also read by" in r.getMessage()
               for r in caplog.records)
    _assert_exact(model, reference, x)


class _Supervised(nn.Module):
    """Returns every layer's output beside its own loss, for a loss on an intermediate one (deep supervision): each
    but the last is also the next layer's input."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.layers = nn.ModuleList(_ScaledLayer(0) for _ in range(4))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        h, outputs = self.inp(x), []
        for layer in self.layers:
            h = layer(h)
            outputs.append(h)
        return self.out(h).square().mean(), outputs


def test_a_returned_layer_input_with_a_loss_on_it_is_traced_whole_and_trains_bitwise(caplog):
    """NOTE [returned layer inputs]: a loss on layer 1's output, which is layer 2's input.  Spliced, its gradient
    summed the caller's part after the layer's own, which differed from eager's by 5.6e-17 on every step (float64);
    traced whole, every step is bitwise, the first plan's included."""
    torch.manual_seed(0)
    model = _Supervised().double().train()
    batches = [(torch.randn(256, 16, dtype=torch.float64),) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        assert_bitwise_at_a_recomputing_budget(model, batches, loss=lambda out: out[0] + out[1][1].square().mean())
    assert any("could not be traced once" in r.getMessage() and "NOTE [returned layer inputs]" in r.getMessage()
               for r in caplog.records), caplog.text


def _assert_exact(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """Planned at the smallest feasible budget, two steps of ``model`` give ``reference``'s gradients bitwise."""
    floor = rematerialize(model, (x,), budget=10**12, verbose=False).plan.min_feasible_bytes
    rm = rematerialize(model, (x,), budget=floor, verbose=False)
    assert sum(b.n_recomputed_ops for b in rm.plan.blocks) > 0
    for seed in (3, 4):
        for module, params in ((rm, model), (reference, reference)):
            params.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            module(x).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad), name


def test_layers_with_hooks_or_buffers_are_traced_whole():
    """A hook or a buffer inside a layer could act outside the traced ops: such layers are not traced once."""
    torch.manual_seed(0)
    hooked = _Stack([_ScaledLayer(0) for _ in range(3)])
    assert RepeatedLayers.of(hooked) is not None
    hooked.layers[1].linear.register_forward_hook(lambda *_: None)
    assert RepeatedLayers.of(hooked) is None
    buffered = _Stack([_ScaledLayer(0) for _ in range(3)])
    for layer in buffered.layers:
        layer.register_buffer("count", torch.zeros(()))
    assert RepeatedLayers.of(buffered) is None


def test_trace_layers_once_option_reads_its_variable():
    assert RematConfig().trace_layers_once is True
    assert RematConfig.from_env({"REMAT_TRACE_LAYERS_ONCE": "0"}).trace_layers_once is False
    with pytest.raises(ConfigError, match="REMAT_TRACE_LAYERS_ONCE"):
        RematConfig.from_env({"REMAT_TRACE_LAYERS_ONCE": "sometimes"})


class _Options:
    """A Python object a layer reads: the opaque op could not carry it, so the model is traced whole."""

    scale = 0.5


class _TakesOptions(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x, options):
        return x + torch.relu(self.linear(x)) * options.scale


class _OptionsStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_TakesOptions() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, _Options())
        return x.square().mean()


def test_a_layer_called_with_a_python_object_is_traced_whole_naming_it(caplog):
    torch.manual_seed(0)
    model = _OptionsStack().double()
    x = torch.randn(64, 32, dtype=torch.float64)
    with caplog.at_level(logging.WARNING, logger="remat_plugin"):
        whole, _ = _joint(model, (x,), {}, once=False)
        spliced, exported = _joint(model, (x,), {}, once=True)
    assert LAYERS_META not in exported.meta
    assert _canonical(spliced.gm) == _canonical(whole.gm)
    said = [r.getMessage() for r in caplog.records if "could not be traced once" in r.getMessage()]
    assert len(said) == 1 and "called with a _Options" in said[0], said


class _SlicedInputs(nn.Module):
    """Each layer reads a slice of a wider tensor: an input whose storage is larger than its elements."""

    def __init__(self):
        super().__init__()
        self.widen = nn.Linear(32, 64)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(self.widen(x)[:, :32]))
        return x.square().mean()


def test_layer_inputs_that_view_a_wider_storage_are_spliced():
    torch.manual_seed(0)
    model, x = _SlicedInputs().double(), torch.randn(16, 32, dtype=torch.float64)
    whole, _ = _joint(model, (x,), {}, once=False)
    spliced, exported = _joint(model, (x,), {}, once=True)
    assert LAYERS_META in exported.meta
    assert _canonical(spliced.gm) == _canonical(whole.gm)


class _ConstantLayer(nn.Module):
    """A layer that makes a tensor in its forward (a table, a scale): the traced layer holds it as a constant."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 32)

    def forward(self, x):
        return x + torch.tanh(self.linear(x)) * torch.tensor([0.5, 2.0], dtype=x.dtype).repeat(16)


class _ConstantStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_ConstantLayer() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_layers_tensor_constant_is_spliced_without_a_warning(recwarn):
    """The spliced calls read the traced layer's constant as make_fx reads its own (FX's ``Graph.get_attr`` warned
    that no parameter or buffer of that name exists, on transformers' Falcon and DeBERTa-v2); gradients bitwise."""
    torch.manual_seed(0)
    model, x = _ConstantStack().double(), torch.randn(16, 32, dtype=torch.float64)
    spliced, exported = _joint(model, (x,), {}, once=True)
    assert LAYERS_META in exported.meta
    assert any(n.op == "get_attr" for n in spliced.gm.graph.nodes)
    assert_bitwise_at_a_recomputing_budget(model, [(x,), (x * 2,)], loss=lambda out: out)
    assert not [w for w in recwarn if "get_attr" in str(w.message)]
