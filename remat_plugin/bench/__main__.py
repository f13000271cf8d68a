"""``python -m remat_plugin.bench``: our plan at several budgets against the checkpointing peers.

Example::

    python -m remat_plugin.bench --model gpt2-tiny --budgets 1.0,0.6,0.4,0.3 --json out.json

Budgets are fractions of the unmodified model's measured step peak. See ``bench/run.py`` for
what is measured and how.

``python -m remat_plugin.bench compare --models gpt2-tiny,bert-tiny --out results/`` adds Chen's
drop-cheap-ops rule and torch.compile's activation_memory_budget to the peers, plans ours at every
peer's measured peak too, and writes a Markdown table, a JSON file and two PNG plots (the
memory–time frontier, the memory timeline of one step); see ``bench/compare.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from remat_plugin.bench.models import ALL_MODELS
from remat_plugin.bench.report import (
    compare_with_peers,
    format_compare,
    format_comparisons,
    format_table,
    frontier_comparison,
    to_json,
)
from remat_plugin.bench.run import LAYER_COUNT_ARG, SHAPE_ARGS, run_bench

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_MODELS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown model(s) {unknown or text!r}; choose from {', '.join(sorted(ALL_MODELS))}"
        )
    return names


def _fractions(text: str) -> list[float]:
    try:
        fractions = [float(f) for f in text.split(",") if f.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read budgets {text!r}; give fractions such as 1.0,0.6,0.4") from None
    if not fractions or any(not f > 0 for f in fractions):
        raise argparse.ArgumentTypeError(f"budgets {text!r} must be positive fractions such as 1.0,0.6,0.4")
    return list(dict.fromkeys(fractions))  # a repeated fraction would only be planned and measured twice


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m remat_plugin.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=_names, default=["gpt2-tiny"], help="model name(s), comma-separated")
    parser.add_argument(
        "--budgets", type=_fractions, default=[1.0, 0.6, 0.4, 0.3],
        help="fractions of the unmodified step's measured peak, comma-separated",
    )  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--pairs", type=int, default=5, help="timed (none, strategy) step pairs, after a warm-up pair")
    parser.add_argument("--n-layer", type=int, default=None, help="number of repeated layers (gpt2-tiny, mlp-chain)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per batch (gpt2-tiny, gpt2-small)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (gpt2-tiny, gpt2-small)")
    parser.add_argument("--seed", type=int, default=0, help="model weights seed")
    parser.add_argument("--json", default=None, help="write every measurement to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="log remat_plugin's planning too")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    fixed = [name for name in args.model if name not in LAYER_COUNT_ARG]
    if args.n_layer is not None and fixed:
        parser.error(f"--n-layer: {', '.join(fixed)} have a fixed depth; it applies to {', '.join(LAYER_COUNT_ARG)}")
    fixed_shape = [name for name in args.model if name not in SHAPE_ARGS]
    if (args.batch_size is not None or args.seq_len is not None) and fixed_shape:
        parser.error(f"--batch-size/--seq-len: {', '.join(fixed_shape)} have a fixed batch shape; they apply to "
                     f"{', '.join(SHAPE_ARGS)}")
    for flag in ("batch_size", "seq_len"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def _setup(args: argparse.Namespace) -> bool:
    """Logging; False (after saying why) when CUDA is asked for and there is none."""
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.WARNING)
    logging.getLogger("remat_plugin" if args.verbose else "remat_plugin.bench").setLevel(logging.INFO)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("remat_plugin.bench: --device cuda asked for, but no CUDA device is available; skipping.")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    if argv[:1] == ["ddp-overlap"]:  # segmented backward against one node under 2-process DDP
        from remat_plugin.bench.ddp_overlap import main as ddp_overlap_main

        ddp_overlap_main(argv[1:])
        return 0
    if argv[:1] == ["fsdp"]:  # FSDP2 units planned against plain FSDP2 and per-layer checkpointing, 2 processes
        from remat_plugin.bench.fsdp_bench import main as fsdp_main

        fsdp_main(argv[1:])
        return 0
    if argv[:1] in (["dropped-outputs"], ["output-liveness"], ["dropout-masks"], ["in-place-adds"]):  # one capture feature on against off
        from remat_plugin.bench.capture_features import main as capture_feature_main

        capture_feature_main(argv[1:], feature=argv[0])
        return 0
    if argv[:1] == ["recompute-breakdown"]:  # a low budget's plan: op times forward and recomputed, by kind of op
        from remat_plugin.bench.recompute_breakdown import main as recompute_breakdown_main

        recompute_breakdown_main(argv[1:])
        return 0
    if argv[:1] == ["overhead-breakdown"]:  # our step against eager's, profiler self time per op
        from remat_plugin.bench.overhead_breakdown import main as overhead_breakdown_main

        overhead_breakdown_main(argv[1:])
        return 0
    if argv[:1] == ["symbolic-capture"]:  # torch's capture with batch and length symbolic against static
        from remat_plugin.bench.symbolic_capture import main as symbolic_capture_main

        symbolic_capture_main(argv[1:])
        return 0
    if argv[:1] == ["ci-durations"]:  # make test's per-file test times, from its JUnit XML
        from remat_plugin.bench.ci_durations import main as ci_durations_main

        ci_durations_main(argv[1:])
        return 0
    if argv[:1] == ["batch-size"]:  # our planned batch size against Lightning's BatchSizeFinder
        from remat_plugin.bench.batch_size_bench import main as batch_size_main

        batch_size_main(argv[1:])
        return 0
    args = parse_args(argv)
    if not _setup(args):
        return 0

    t0 = time.perf_counter()
    rows = run_bench(
        args.model, args.budgets, args.device, DTYPES[args.dtype], args.pairs, n_layer=args.n_layer,
        batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
    )
    wall_s = time.perf_counter() - t0

    print(format_table(rows))
    comparisons = format_comparisons(compare_with_peers(rows))
    if comparisons:
        print()
        print(comparisons)
    print(f"\n{args.device}, {args.dtype}, {args.pairs} timing pairs; benchmark took {wall_s:.0f} s.")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        settings["wall_s"] = wall_s
        with open(args.json, "w") as f:
            f.write(to_json(rows, settings))
    return 0


# --- compare ----------------------------------------------------------------------------------


def _ratios(text: str) -> list[float]:
    try:
        ratios = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read ratios {text!r}; give values in [0, 1] such as 1,0.5") from None
    if not ratios or any(not 0 <= r <= 1 for r in ratios):
        raise argparse.ArgumentTypeError(f"activation_memory_budget ratios {text!r} must lie in [0, 1]")
    return list(dict.fromkeys(ratios))


def parse_compare_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m remat_plugin.bench compare",
        description="Ours against every peer (checkpointing, Chen's rules, torch.compile's"
        " activation_memory_budget) on one memory-time frontier: table, JSON, plots.",
    )
    parser.add_argument("--models", type=_names, default=["gpt2-tiny", "bert-tiny", "resnet-tiny", "mlp-chain"],
                        help="model names, comma-separated")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--out", default="results", help="folder for compare_<device>.{md,json,frontier.png,timeline.png}")
    parser.add_argument("--pairs", type=int, default=5, help="timed (none, strategy) step pairs per point")
    parser.add_argument("--budgets", type=_fractions, default=[1.0, 0.5, 0.3],
                        help="our budgets as fractions of none's measured peak (besides the peers' peaks)")  # fmt: skip
    parser.add_argument("--amb-ratios", type=_ratios, default=[1.0, 0.7, 0.5, 0.3],
                        help="torch.compile activation_memory_budget values")  # fmt: skip
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: aot_eager on CPU, inductor on CUDA)")
    parser.add_argument("--no-match", action="store_true", help="do not plan ours at each peer's measured peak")
    parser.add_argument("--ours-inductor", action="store_true",
                        help="also run ours with compile=True (inductor kernels) at --budgets and torch.compile's peaks")
    parser.add_argument("--timeline-budget", type=float, default=0.4,
                        help="the timeline shows ours at the feasible budget nearest this fraction")  # fmt: skip
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before running")
    parser.add_argument("--seed", type=int, default=0, help="model weights seed")
    parser.add_argument("-v", "--verbose", action="store_true", help="log remat_plugin's planning too")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.threads is not None and args.threads < 1:
        parser.error("--threads must be at least 1")
    return args


METER_NOTES = {
    "cpu": "allocator events of the profiler (capture.memory_meter.measure_peak_profiler) for every point, the only"
    " CPU meter that sees compiled graphs; the dispatch-mode PeakMeter is shown for eager points as a cross-check.",
    "cuda": "max_memory_allocated above the step's start (PeakMeter) for every point.",
}


def _machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def compare_main(argv: list[str]) -> int:
    """Run the comparison and write ``compare_<device>.md``, ``.json``, ``.frontier.png``, ``.timeline.png``."""
    from remat_plugin.bench.compare import COMPARE_SCHEMA_VERSION, CompareSettings, run_compare
    from remat_plugin.bench.plots import plot_frontier, plot_timelines

    args = parse_compare_args(argv)
    if not _setup(args):
        return 0
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = CompareSettings(
        models=tuple(args.models), device=args.device, dtype=args.dtype, pairs=args.pairs,
        fractions=tuple(args.budgets), amb_ratios=tuple(args.amb_ratios), backend=args.backend,
        ours_inductor=args.ours_inductor,
        match_peers=not args.no_match, timeline_fraction=args.timeline_budget, seed=args.seed,
    )  # fmt: skip
    t0 = time.perf_counter()
    result = run_compare(settings)
    payload: dict[str, Any] = {
        "schema_version": COMPARE_SCHEMA_VERSION,
        "settings": {
            **dataclasses.asdict(settings),
            "backend": args.backend or ("inductor" if args.device == "cuda" else "aot_eager"),  # peers.py's default
            "threads": torch.get_num_threads(),
        },
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "machine": _machine(args.device),
        "torch_version": torch.__version__,
        "wall_s": time.perf_counter() - t0,
        "meter_note": METER_NOTES[args.device],
        "points": result["points"],
        "comparisons": frontier_comparison(result["points"]),
        "timelines": result["timelines"],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"compare_{args.device}"
    markdown = format_compare(payload)
    Path(f"{stem}.md").write_text(markdown)
    Path(f"{stem}.json").write_text(json.dumps(payload, indent=1))
    plot_frontier(payload["points"], f"{stem}.frontier.png", args.device)
    plot_timelines(payload["timelines"], f"{stem}.timeline.png", args.device)
    print(markdown)
    print(f"wrote {stem}.md, .json, .frontier.png, .timeline.png; compare took {payload['wall_s']:.0f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
