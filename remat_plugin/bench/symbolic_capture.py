"""What a capture symbolic in batch and sequence length costs against the static one planning uses.

    python -m remat_plugin.bench symbolic-capture [--model gpt2-tiny] [--repeats 5]
        [--json results/symbolic_capture_cpu.json]

A step at a new shape inside a planned bucket replays the bucket's plan but captures its own graph
(export and trace, about 1 s on gpt2-tiny); replaying without a capture needs a graph whose sizes
are symbols.  This times torch's two capture stages both ways, on the model's first batch:
``torch.export.export`` with every input's first two dimensions static, and with them as ``Dim``s;
and a trace of the joint forward and backward (``make_fx``) on fake tensors, and on symbolic ones.
Rounds alternate static and symbolic, so a slow spell of the machine falls on both; each reports
its median.  The symbolic export is checked to run at a shorter length with eager's loss, and the
symbolic joint trace to take inputs of symbolic sizes, so the times are those of graphs a replay
could start from (our capture's own passes on symbolic sizes, which do not exist, would come on top).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.export import Dim, export
from torch.fx.experimental.proxy_tensor import make_fx

from remat_plugin.bench.models import build

STAGES = ("export", "joint trace")


def _exporter(module: torch.nn.Module, args: tuple, kwargs: dict, symbolic: bool) -> Callable[[], object]:
    """``torch.export`` of the module on its batch; ``symbolic``: every tensor input's first two dims as Dims."""
    dims = (Dim("batch", min=2, max=1 << 16), Dim("length", min=2, max=1 << 16))

    def spec(x):
        return {i: dims[i] for i in range(min(2, x.dim()))} if isinstance(x, torch.Tensor) else None

    shapes = {k: spec(v) for k, v in kwargs.items()} if symbolic else None
    return lambda: export(module, args, kwargs, dynamic_shapes=shapes)


def _joint_tracer(module: torch.nn.Module, args: tuple, kwargs: dict, loss: Callable,
                  symbolic: bool) -> Callable[[], torch.fx.GraphModule]:
    """``make_fx`` of forward, loss and the parameters' gradients, on fake (static) or symbolic sizes."""
    params = {k: p for k, p in module.named_parameters() if p.requires_grad}

    def step(params, args, kwargs):
        out = torch.func.functional_call(module, params, args, kwargs)
        return torch.autograd.grad(loss(out), list(params.values()), allow_unused=True)

    if symbolic:
        return lambda: make_fx(step, tracing_mode="symbolic")(params, args, kwargs)
    return lambda: make_fx(step, tracing_mode="fake")(params, args, kwargs)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def check_symbolic(model: str, bench, exported, joint: torch.fx.GraphModule) -> dict:
    """That the symbolic graphs are symbolic: the exported program runs at a shorter length with eager's loss, and the
    joint graph's placeholders carry symbolic sizes."""
    second_shape = _shape(bench, shorter=True)
    other_args, other_kwargs = build(model, **second_shape).make_batch(1)
    torch.manual_seed(0)
    got = bench.loss(exported.module()(*other_args, **other_kwargs))
    torch.manual_seed(0)
    want = bench.loss(bench.module(*other_args, **other_kwargs))
    sym_placeholders = sum(
        1 for n in joint.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
        and any(isinstance(s, torch.SymInt) for s in n.meta["val"].shape)
    )
    return {"second_shape": second_shape, "exported_loss_equal": bool(torch.equal(got, want)),
            "joint_symbolic_placeholders": sym_placeholders}


def _shape(bench, shorter: bool = False) -> dict:
    """The bench's batch and sequence length; ``shorter``: three quarters of the length, a shape inside its bucket."""
    meta = bench.meta
    return {"batch_size": meta["batch_size"], "seq_len": meta["seq_len"] * 3 // 4 if shorter else meta["seq_len"],
            **({"n_layer": meta["n_layer"]} if "n_layer" in meta else {})}


def run(model: str, repeats: int, **shape) -> dict:
    """Alternating static and symbolic rounds of both stages; medians, and the symbolic graphs checked."""
    bench = build(model, **shape)
    if "seq_len" not in bench.meta:
        raise ValueError(f"symbolic-capture: {model} has no sequence length to make symbolic; choose a language "
                         "model such as gpt2-tiny")
    module = bench.module
    config = getattr(module, "config", None)
    if config is not None:
        config.use_cache = False  # a training step's capture, as planning's
    args, kwargs = bench.make_batch(0)
    makers = {
        "export, static": _exporter(module, args, kwargs, False),
        "export, symbolic": _exporter(module, args, kwargs, True),
        "joint trace, static": _joint_tracer(module, args, kwargs, bench.loss, False),
        "joint trace, symbolic": _joint_tracer(module, args, kwargs, bench.loss, True),
    }
    times: dict[str, list[float]] = {label: [] for label in makers}
    last: dict[str, object] = {}
    for _ in range(repeats):
        for label, make in makers.items():
            seconds, last[label] = _timed(make)
            times[label].append(seconds)
    medians = {label: statistics.median(runs) for label, runs in times.items()}
    static = sum(medians[f"{s}, static"] for s in STAGES)
    symbolic = sum(medians[f"{s}, symbolic"] for s in STAGES)
    checks = check_symbolic(model, bench, last["export, symbolic"], last["joint trace, symbolic"])  # type: ignore[arg-type]
    return {"model": model, "shape": _shape(bench), "torch": torch.__version__, "repeats": repeats,
            "median_s": medians, "runs_s": times,
            "static_s": static, "symbolic_s": symbolic, "ratio": symbolic / static, **checks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m remat_plugin.bench symbolic-capture",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny", help="a bench model with batch_size and seq_len arguments")
    parser.add_argument("--repeats", type=int, default=5, help="rounds, each timing all four captures once")
    parser.add_argument("--json", help="write the results here")
    opts = parser.parse_args(argv)
    result = run(opts.model, opts.repeats)
    for key, seconds in result["median_s"].items():
        print(f"{key:24s} {seconds:6.2f} s")
    print(f"static {result['static_s']:.2f} s, symbolic {result['symbolic_s']:.2f} s: {result['ratio']:.2f}x "
          f"(torch {result['torch']}, {result['model']} {result['shape']}, medians of {result['repeats']} rounds); "
          f"exported graph at {result['second_shape']}: loss equal to eager's: {result['exported_loss_equal']}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)
