"""``python -m remat_plugin.bench``: our plan at several budgets against the checkpointing peers.

Example::

    python -m remat_plugin.bench --model gpt2-tiny --budgets 1.0,0.6,0.4,0.3 --json out.json

Budgets are fractions of the unmodified model's measured step peak. See ``bench/run.py`` for
what is measured and how.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from remat_plugin.bench.models import MODELS
from remat_plugin.bench.report import compare_with_peers, format_comparisons, format_table, to_json
from remat_plugin.bench.run import LAYER_COUNT_ARG, run_bench

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown model(s) {unknown or text!r}; choose from {', '.join(sorted(MODELS))}"
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
    parser.add_argument("--seed", type=int, default=0, help="model weights seed")
    parser.add_argument("--json", default=None, help="write every measurement to this file")
    parser.add_argument("-v", "--verbose", action="store_true", help="log remat_plugin's planning too")
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    fixed = [name for name in args.model if name not in LAYER_COUNT_ARG]
    if args.n_layer is not None and fixed:
        parser.error(f"--n-layer: {', '.join(fixed)} have a fixed depth; it applies to {', '.join(LAYER_COUNT_ARG)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.WARNING)
    logging.getLogger("remat_plugin" if args.verbose else "remat_plugin.bench").setLevel(logging.INFO)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("remat_plugin.bench: --device cuda asked for, but no CUDA device is available; skipping.")
        return 0

    t0 = time.perf_counter()
    rows = run_bench(
        args.model, args.budgets, args.device, DTYPES[args.dtype], args.pairs, n_layer=args.n_layer, seed=args.seed
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


if __name__ == "__main__":
    sys.exit(main())
