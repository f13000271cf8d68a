"""``remat plan`` and ``remat report``: decide whether a model fits before renting the GPU, and see why.

``remat plan MODEL --batch-size 8 --seq-len 1024 --budget 12GiB --device meta`` captures the
model, costs its ops (measured on ``cpu``/``cuda``, estimated from FLOPs and bytes on
``meta``, where nothing is allocated), plans, and prints the plan: per block its mode, kept
bytes, recomputed ops and recompute time; the predicted peak against the budget, the
predicted overhead and the smallest feasible budget.  ``--json`` writes the plan with its
memory timeline, which ``remat report`` draws.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from remat_plugin.cli.model_source import ModelSpecError, load_model
from remat_plugin.errors import BudgetFormatError, CaptureError, InfeasibleBudgetError, human_bytes
from remat_plugin.ir.plan import Plan
from remat_plugin.ir.problem import Schedule
from remat_plugin.ir.simulate import simulate
from remat_plugin.planning.choose_plan import make_plan
from remat_plugin.planning.menus import DEFAULT_ILP_TIME_LIMIT_S
from remat_plugin.runtime.budget import parse_budget
from remat_plugin.runtime.progress import PlanningProgress
from remat_plugin.runtime.steps import capture_problem

log = logging.getLogger(__name__)


def add_plan_parser(commands) -> None:
    p = commands.add_parser("plan", help="plan a model under a budget and print the plan (no training)",
                            description=__doc__.splitlines()[0])
    p.add_argument("model", metavar="MODEL",
                   help="a preset (gpt2, llama, bert, gpt2-medium), an HF config .json, or module:factory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--budget", required=True,
                   help="forward+backward budget: bytes (300000000), a size ('300MiB', '12GiB', '800MB'; one word) "
                        "or a share of free memory ('80%%', not on meta)")
    p.add_argument("--device", choices=["cpu", "cuda", "meta"], default="cpu",
                   help="where to capture and cost the model; meta allocates nothing and estimates op times")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "float64"], default="float32")
    p.add_argument("--ilp-time-limit-s", type=float, default=DEFAULT_ILP_TIME_LIMIT_S, help="wall-clock safety net of each block ILP solve, seconds (solves stop on counts of work first)")
    p.add_argument("--json", metavar="PATH", help="write the plan (with its memory timeline) to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def add_report_parser(commands) -> None:
    p = commands.add_parser("report", help="draw a plan's memory timeline (PNG)",
                            description="Render the memory timeline written by `remat plan --json`.")
    p.add_argument("plan", metavar="PLAN.json")
    p.add_argument("--out", help="PNG path (default: PLAN.png next to the JSON)")


def _budget_bytes(text: str, device: torch.device) -> int:
    if device.type == "meta" and text.strip().endswith("%"):
        raise BudgetFormatError(option="budget", value=text, accepted="a size such as '12GiB'",
                                reason=f"budget {text!r} is a share of free memory, which the meta device does not have")
    return parse_budget(int(text) if text.strip().isdigit() else text, device)


def run_plan(args: argparse.Namespace) -> int:
    """Exit codes: 0 planned, 1 infeasible (the smallest feasible budget is printed), 2 bad input."""
    logging.getLogger("remat_plugin.progress").setLevel(logging.WARNING if args.quiet else logging.INFO)
    device = torch.device(args.device)
    try:
        budget = _budget_bytes(args.budget, device)
        if args.batch_size <= 0 or args.seq_len <= 0:
            raise ModelSpecError("remat plan: --batch-size and --seq-len must be positive")
        dtype = getattr(torch, args.dtype)
        t0 = time.perf_counter()
        with PlanningProgress("remat plan") as progress:
            progress.stage("build model")
            model, margs, mkwargs = load_model(args.model, args.batch_size, args.seq_len, device)
            model.to(dtype)
            problem, constants = capture_problem(model, margs, mkwargs, progress=progress)
            progress.stage("solve blocks, chain DP")
            plan, schedule = make_plan(problem, constants, budget, args.ilp_time_limit_s, progress)
    except (BudgetFormatError, ModelSpecError, CaptureError) as exc:  # CaptureError: the model's line is named
        print(f"remat plan: error: {exc}", file=sys.stderr)
        return 2
    except InfeasibleBudgetError as exc:
        print(str(exc))
        return 1
    print(f"{args.model}: batch {args.batch_size} x {args.seq_len} tokens, {args.dtype}, device {args.device}"
          f" ({'estimated op times' if device.type == 'meta' else 'measured op times'}); "
          f"planned in {time.perf_counter() - t0:.1f} s")
    print(plan.table())
    print(f"predicted peak {human_bytes(plan.predicted_peak_bytes)} of budget {human_bytes(plan.budget_bytes)}; "
          f"predicted overhead {plan.predicted_overhead:.3f}x; smallest feasible budget "
          f"{human_bytes(plan.min_feasible_bytes)} ({plan.min_feasible_bytes} bytes)")
    if args.json:
        planned = simulate(problem, schedule)
        unmodified = simulate(problem, Schedule.keep_all(problem))
        import dataclasses

        plan = dataclasses.replace(plan, timeline_bytes=planned.timeline_bytes,
                                   baseline_timeline_bytes=unmodified.timeline_bytes,
                                   n_fwd_ops=len(problem.fwd_ops), signature=f"{args.model} {args.batch_size}x"
                                   f"{args.seq_len} {args.dtype} {args.device}")
        with open(args.json, "w") as f:
            f.write(plan.to_json())
        print(f"plan written to {args.json}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from remat_plugin.cli.timeline_plot import plot_timeline

    try:
        with open(args.plan) as f:
            plan = Plan.from_json(f.read())
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"remat report: error: cannot read plan {args.plan!r}: {exc}", file=sys.stderr)
        return 2
    if not plan.timeline_bytes:
        print(f"remat report: error: {args.plan} has no memory timeline; write it with `remat plan ... --json`",
              file=sys.stderr)
        return 2
    out = args.out or args.plan.removesuffix(".json") + ".png"
    plot_timeline(plan, out)
    print(f"memory timeline written to {out}")
    return 0
