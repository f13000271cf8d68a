"""One capture feature on against off: two copies of a model planned at one budget, stepped interleaved.

    python -m remat_plugin.bench dropped-outputs [--model gpt2-tiny] [--budget 0.5] [--pairs 9]
        [--hold-outputs] [--json results/dropped_outputs_cpu.json]
    python -m remat_plugin.bench output-liveness [--budget 0.5] [--match-step 1] [--json ...]
    python -m remat_plugin.bench dropout-masks [--model gpt2-tiny] [--budget 0.4] [--pairs 9] [--json ...]
    python -m remat_plugin.bench in-place-adds [--model gpt2-tiny] [--budget 1.0] [--pairs 9] [--json ...]

``dropped-outputs``: ``folded`` as the package runs (NOTE [dropped tangents]: no logits-sized zero
gradient, no add) against ``materialized``, autograd filling the logits' gradient with zeros that
the program adds.  ``output-liveness``: ``freed`` as the package runs (NOTE [output usage]: the outputs the
loop drops freed after the forward, without gradients) against ``kept``, the first plan's way (every output kept
to the step's end, its gradient zeros that the program adds).  ``dropout-masks``: ``split`` as the package runs (NOTE [dropout masks]: a CPU
dropout is its mask and a multiply) against ``whole``, each dropout one random op.  ``in-place-adds``:
``in-place`` as the package runs (NOTE [in-place adds]) against ``functional``, every add out of place.

The loop keeps ``.loss`` and drops the logits (with ``--hold-outputs`` it holds the output object
through ``backward()``, as ``out = model(...); out.loss.backward()`` does).  Both copies are planned at
the same budget (a fraction of the unmodified step's measured peak), each with its feature setting
for every capture.  Each plan settles first (the re-plan for the dropped logits included); then one
metered step each (allocator peak, gradients against the unmodified model's) and timed rounds of the
unmodified step and both variants, the order rotating.  Reported: the plans' smallest feasible budgets
and predictions, measured peaks, median step times, each variant's measured overhead (the median of its
step over the unmodified one in the same round) beside its plan's prediction, and the on/off ratio.
With ``--match-step`` the feature on is also planned at the lowest budget, that many MiB apart below the budget,
whose plan predicts no slower than the feature off at the budget (``<on>-matched``): the memory the feature saves
at the same speed, metered and timed in the same rounds.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import statistics
import time
from collections.abc import Callable

import torch

from remat_plugin.bench.models import build
from remat_plugin.capture.dropout_masks import dropouts_as_traced
from remat_plugin.capture.dropped_tangents import tangents_materialized
from remat_plugin.capture.in_place_adds import adds_functional
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.errors import InfeasibleBudgetError
from remat_plugin.runtime.module import RematModule
from remat_plugin.runtime.resolver import outputs_planned_as_first
from remat_plugin.runtime.side_effects import unobserved

# feature -> (its variant on, its variant off, what turns it off for the captures inside)
Switch = Callable[[], contextlib.AbstractContextManager]
FEATURES: dict[str, tuple[str, str, Switch]] = {
    "dropped-outputs": ("folded", "materialized", tangents_materialized),
    "output-liveness": ("freed", "kept", outputs_planned_as_first),
    "dropout-masks": ("split", "whole", dropouts_as_traced),
    "in-place-adds": ("in-place", "functional", adds_functional),
}
SEED = 1234
MATCH_STEPS = 24  # budgets tried below the budget for the matched variant


def _step(module, bench, batch, hold: bool = False) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    torch.manual_seed(SEED)
    out = module(*batch[0], **batch[1])
    loss = bench.loss(out)
    if not hold:
        del out  # the loop keeps the loss only: the logits are dropped here
    loss.backward()  # with hold, the logits stay alive through the backward, which takes no gradient of them
    return loss


def _grads(module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def _same(grads: list[torch.Tensor | None], others: list[torch.Tensor | None]) -> bool:
    return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
               for a, b in zip(grads, others))


def _planned(bench, batch, budget: int, switch, hold: bool) -> RematModule:
    rm = RematModule(bench.module, budget, verbose=False)
    device = next(bench.module.parameters()).device
    with unobserved(bench.module, device), switch():
        for _ in range(4):  # plan, re-plan for the dropped logits, settle
            _step(rm, bench, batch, hold)
    return rm


def _on_a_copy(bench, module: torch.nn.Module):
    """``bench`` stepping its own deep copy of ``module``."""
    copied = copy.copy(bench)
    copied.module = copy.deepcopy(module)
    return copied


def _matched(bench, reference: torch.nn.Module, batch, budget: int, step_bytes: int, hold: bool,
             slowest: float) -> tuple[RematModule, int]:
    """The feature on at the lowest budget, ``step_bytes`` apart below ``budget``, whose plan predicts no slower than
    ``slowest``: the memory it saves at the same speed (the scan stops at the first budget that is slower or
    infeasible)."""
    best: tuple[RematModule, int] | None = None
    for k in range(1, MATCH_STEPS + 1):
        lower = budget - k * step_bytes
        try:
            rm = _planned(_on_a_copy(bench, reference), batch, lower, contextlib.nullcontext, hold)
        except InfeasibleBudgetError:
            break
        assert rm.plan is not None
        if rm.plan.predicted_overhead > slowest:
            break
        best = (rm, lower)
    if best is None:
        raise RuntimeError(f"no budget {step_bytes / 2**20:.2f} MiB or more below {budget / 2**20:.2f} MiB plans as "
                           f"fast as the feature turned off ({slowest:.4f}x); nothing to match")
    return best


def run(model: str, budget_fraction: float, pairs: int, hold: bool = False, feature: str = "dropped-outputs",
        match_step_mib: float | None = None) -> dict:
    """``match_step_mib``: also plan the feature on at the lowest budget, that many MiB apart below the budget,
    whose plan predicts no slower than the feature off at the budget (variant ``<on>-matched``)."""
    on, off, turned_off = FEATURES[feature]
    switches: dict[str, Switch] = {on: contextlib.nullcontext, off: turned_off}
    bench = build(model)
    batch = bench.make_batch(0)
    reference = copy.deepcopy(bench.module)
    # The oracle is the unmodified model's second step: a fresh process's first fp32 step was seen to differ
    # from every later one (2e-7, all parameters) in 1 of 5 runs, while the planned copies' gradients were the
    # same in all five.  Both steps' gradients are kept, so a run says whether the oracle repeated itself.
    _step(reference, bench, batch, hold)
    first_grads = _grads(reference)
    _, none_peak = measure_peak_profiler(lambda: _step(reference, bench, batch, hold))
    reference_grads = _grads(reference)
    reference_repeatable = _same(first_grads, reference_grads)
    budget = int(budget_fraction * none_peak)
    modules: dict[str, RematModule] = {}
    budgets: dict[str, int] = {}
    out: dict[str, dict] = {}
    for variant in (on, off):
        modules[variant] = _planned(_on_a_copy(bench, reference), batch, budget, switches[variant], hold)
        budgets[variant] = budget
    if match_step_mib is not None:
        matched = f"{on}-matched"
        slowest = modules[off].plan.predicted_overhead  # type: ignore[union-attr]
        modules[matched], budgets[matched] = _matched(bench, reference, batch, budget, int(match_step_mib * 2**20),
                                                      hold, slowest)
        switches[matched] = contextlib.nullcontext
    variants = tuple(modules)
    for variant in variants:
        rm = modules[variant]
        plan = rm.plan
        assert plan is not None
        with switches[variant]():
            _, peak = measure_peak_profiler(functools.partial(_step, rm, bench, batch, hold))
        grads = _grads(rm)
        out[variant] = {
            "budget_bytes": budgets[variant],
            "measured_peak_bytes": peak,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "predicted_overhead": plan.predicted_overhead,
            "min_feasible_bytes": plan.min_feasible_bytes,
            "dropped_outputs": list(plan.dropped_outputs),
            "ungraded_outputs": list(plan.ungraded_outputs),
            "grads_bitwise": _same(grads, reference_grads),
            "within_budget": peak <= budgets[variant],
            # the largest difference and the parameters it is in, so a run that is not bitwise says by how much
            "grad_max_abs_diff": max((float((a - b).abs().max()) for a, b in zip(grads, reference_grads)
                                      if a is not None and b is not None), default=0.0),
            "grads_differing": [name for (name, _), a, b in zip(rm.named_parameters(), grads, reference_grads)
                                if a is not None and b is not None and not torch.equal(a, b)],
        }
    plans = {v: modules[v].plan for v in variants}
    # Each round steps the unmodified model and every variant, the order rotating, so each variant's step time is
    # also read against the unmodified step's (its measured overhead, beside the plan's prediction).
    stepped: dict[str, torch.nn.Module] = {"none": reference, **modules}
    switches["none"] = contextlib.nullcontext
    names = ("none", *variants)
    times: dict[str, list[float]] = {v: [] for v in names}
    for k in range(pairs + 1):
        for variant in names[k % len(names):] + names[:k % len(names)]:
            with switches[variant]():
                t0 = time.perf_counter()
                _step(stepped[variant], bench, batch, hold)
                elapsed = time.perf_counter() - t0
            if k:  # the first round warms up
                times[variant].append(elapsed)
    assert all(modules[v].plan is plans[v] for v in variants), "a plan changed while timing"
    for variant in variants:
        out[variant]["median_step_s"] = statistics.median(times[variant])
        out[variant]["step_s"] = times[variant]
        out[variant]["measured_overhead"] = statistics.median(a / b for a, b in zip(times[variant], times["none"]))
    ratios = {v: statistics.median(a / b for a, b in zip(times[v], times[off])) for v in variants if v != off}
    return {"feature": feature, "on": on, "off": off, "model": model, "hold_outputs": hold,
            "budget_fraction": budget_fraction, "budget_bytes": budget, "none_peak_bytes": none_peak,
            "reference_repeatable": reference_repeatable,
            "pairs": pairs, "variants": out, "median_time_ratio": ratios[on], "median_time_ratios": ratios,
            "none_step_s": times["none"],
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None, feature: str = "dropped-outputs") -> None:
    parser = argparse.ArgumentParser(prog=f"python -m remat_plugin.bench {feature}", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-tiny")
    parser.add_argument("--budget", type=float, default=0.5, help="the budget, as a fraction of the unmodified peak")
    parser.add_argument("--pairs", type=int, default=9)
    parser.add_argument("--hold-outputs", action="store_true",
                        help="the loop holds the model's output through backward (out = model(...); "
                             "out.loss.backward()) instead of keeping the loss only")
    parser.add_argument("--match-step", type=float, metavar="MIB",
                        help="also plan the feature on at the lowest budget, this many MiB apart below the budget, "
                             "that predicts no slower than the feature off at the budget")
    parser.add_argument("--json")
    opts = parser.parse_args(argv)
    if opts.match_step is not None and opts.match_step <= 0:
        parser.error(f"--match-step must be a positive number of MiB, not {opts.match_step}")
    result = run(opts.model, opts.budget, opts.pairs, opts.hold_outputs, feature, opts.match_step)
    idiom = ("holds the output through backward, no gradient reaching the logits" if opts.hold_outputs
             else "keeps .loss and drops the logits")
    print(f"{opts.model}, budget {opts.budget} of the unmodified peak ({_mib(result['budget_bytes'])}), "
          f"the loop {idiom}; {opts.pairs} rounds of the unmodified step and both variants, interleaved, medians; "
          f"the unmodified model's first two steps' "
          f"gradients {'equal' if result['reference_repeatable'] else 'DIFFER (the oracle is its second step)'}")
    for variant, r in result["variants"].items():
        print(f"  {variant:13s} budget {_mib(r['budget_bytes'])}, smallest feasible {_mib(r['min_feasible_bytes'])}, measured peak "
              f"{_mib(r['measured_peak_bytes'])} (predicted {_mib(r['predicted_peak_bytes'])}, within budget "
              f"{r['within_budget']}), predicted {r['predicted_overhead']:.3f}x, measured {r['measured_overhead']:.3f}x, "
              f"step {r['median_step_s'] * 1e3:.0f} ms, "
              f"gradients bitwise those of the unmodified model: {r['grads_bitwise']}"
              + ("" if r["grads_bitwise"] else f" (max abs diff {r['grad_max_abs_diff']:.3g} in "
                 f"{len(r['grads_differing'])} parameters, first {r['grads_differing'][:3]})"))
    on, off = result["on"], result["off"]
    f, m = result["variants"][on], result["variants"][off]
    print(f"  {on} against {off}: smallest feasible {(f['min_feasible_bytes'] - m['min_feasible_bytes']) / 2**20:+.2f} "
          f"MiB, step time {result['median_time_ratio']:.3f}x")
    matched = result["variants"].get(f"{on}-matched")
    if matched is not None:
        print(f"  {on}-matched against {off}: measured peak "
              f"{(matched['measured_peak_bytes'] - m['measured_peak_bytes']) / 2**20:+.2f} MiB, step time "
              f"{result['median_time_ratios'][f'{on}-matched']:.3f}x (predicted {matched['predicted_overhead']:.4f}x "
              f"against {m['predicted_overhead']:.4f}x)")
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(result, fh, indent=1)
