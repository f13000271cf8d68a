"""``compile=True``: our planned programs run as inductor kernels (NOTE [compiled programs]), and a model the
user compiled is refused with the way to have both."""
import pytest
import torch
from budgets import settle, train_step

from remat_plugin import rematerialize
from remat_plugin.bench.models import build
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.errors import RematError
from remat_plugin.runtime.config import ConfigError, RematConfig
from remat_plugin.torch_private import reset_dynamo

MODELS = {"gpt2-tiny": {"n_layer": 2, "batch_size": 4, "seq_len": 128},
          "bert-tiny": {"n_layer": 2, "batch_size": 4, "seq_len": 128}}


def _step(module, bench, batch):
    return train_step(module, bench, batch, seed=11)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_plan_matches_eager_and_stays_under_budget(name):
    """Dropout on, half the unmodified peak: inductor kernels run our schedule (random ops stay eager, on the
    caller's generator), gradients within 1e-5 of eager, the allocator's peak within the budget."""
    bench = build(name, seed=0, **MODELS[name])
    batch = bench.make_batch(0)
    loss_ref = _step(bench.module, bench, batch)
    grads_ref = [p.grad.clone() for p in bench.module.parameters()]
    plan = rematerialize(bench.module, *batch, budget=10**12, verbose=False).plan
    budget = (plan.baseline_peak_bytes + plan.min_feasible_bytes) // 2
    rm = rematerialize(bench.module, *batch, budget=budget, compile=True, verbose=False)
    assert any(b.n_recomputed_ops for b in rm.plan.blocks)
    settle(lambda: _step(rm, bench, batch))
    programs = [getattr(f, "n_compiled", 0) for f in rm.steps[rm.plan.signature].compiled_programs()]
    assert len(programs) == 2 and all(n > 0 for n in programs), programs
    loss = _step(rm, bench, batch)
    assert torch.allclose(loss, loss_ref, rtol=0, atol=1e-5), (loss, loss_ref)
    for p, g in zip(bench.module.parameters(), grads_ref):
        assert torch.allclose(p.grad, g, rtol=0, atol=1e-5), (p.grad - g).abs().max()
    measured = measure_peak_profiler(lambda: _step(rm, bench, batch))[1]
    assert measured <= budget, (measured, budget)


class _ConvResize(torch.nn.Module):
    """Convolutions and bilinear resizes, dropout between: inductor's layout optimization made a segment hand on a
    channels-last value the next one was traced contiguous for (its input stride assertion failed)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.GELU(), torch.nn.Dropout(0.1)) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            up = torch.nn.functional.interpolate(block(x), size=(37, 33), mode="bilinear")
            x = x + torch.nn.functional.interpolate(up, size=x.shape[-2:], mode="bilinear")
        return x.square().mean()


def test_a_compiled_conv_model_keeps_the_traced_strides(monkeypatch):
    # CI set (GitHub Actions sets it): inductor refuses to fall back to an op torch._decomp can decompose, as
    # the bilinear resize the trace keeps as eager runs it (NOTE [interpolations in the trace]).
    monkeypatch.setenv("CI", "1")
    torch.manual_seed(0)
    model, x = _ConvResize(), torch.randn(2, 4, 24, 27)
    reference = _ConvResize()
    reference.load_state_dict(model.state_dict())
    rm = rematerialize(model, (x,), budget=10**12, compile=True, verbose=False)
    for m in (rm, reference):
        torch.manual_seed(5)
        m(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-5), (p.grad - q.grad).abs().max()


def test_a_compiled_model_is_refused_naming_compile_true():
    bench = build("mlp-chain", seed=0)
    with pytest.raises(RematError, match=r"torch\.compile.*compile=True"):
        rematerialize(torch.compile(bench.module), *bench.make_batch(0), budget="1GB")


def test_compiling_the_planned_module_is_refused_naming_compile_true():
    """``torch.compile(rm)`` (or ``rm.compile()``) is refused at its first call with the way to compile the planned
    step; dynamo used to compile our capture code and fail deep inside torch."""
    bench = build("mlp-chain", seed=0)
    args, kwargs = bench.make_batch(0)
    rm = rematerialize(bench.module, args, kwargs, budget="1GB", verbose=False)
    with pytest.raises(RematError, match=r"torch\.compile\(rm\).*compile=True"):
        torch.compile(rm)(*args, **kwargs)
    reset_dynamo()


def test_remat_compile_variable():
    assert RematConfig.from_env({"REMAT_COMPILE": "1"}).compile is True
    assert RematConfig.from_env({"REMAT_COMPILE": "no"}).compile is False
    with pytest.raises(ConfigError, match="REMAT_COMPILE"):
        RematConfig.from_env({"REMAT_COMPILE": "maybe"})


def test_segments_exchange_tensors_when_a_getitem_comes_late():
    """The executor derives some getitems of views at their first use, after a random op: a compiled segment
    still hands over tensors, never a multi-output op's tuple, and the random op draws what eager draws."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from remat_plugin.capture.compiled_programs import compile_program

    def f(x):
        a, b = torch.ops.aten.split.Tensor(torch.ops.aten.mul.Tensor(x, 2.0), 4)
        r = torch.ops.aten.rand_like.default(a)
        return (torch.ops.aten.add.Tensor(torch.ops.aten.mul.Tensor(a, r), torch.ops.aten.sin.default(b)),)

    x = torch.randn(8, 4)
    gm = make_fx(f, tracing_mode="fake")(x)
    nodes = {n.name: n for n in gm.graph.nodes}
    late = next(n for n in gm.graph.nodes if n.op == "call_function" and "getitem" in n.name
                and n.args[1] == 1)
    nodes["rand_like"].append(late)  # b's getitem after the random op, as the executor may emit it
    gm.recompile()
    program = compile_program(gm)
    assert program.n_compiled >= 1
    torch.manual_seed(4)
    expected = f(x)[0]
    torch.manual_seed(4)
    got = program([x])[0]
    assert torch.allclose(got, expected, rtol=0, atol=1e-6)
