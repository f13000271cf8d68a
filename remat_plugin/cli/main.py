"""The ``remat`` command: ``plan`` and ``report`` (see :mod:`remat_plugin.cli.plan_commands`) and ``launch``.

``remat launch --budget 80% [accelerate launch args] train.py [script args]``:

``launch`` checks the remat options before any process starts, puts them in ``REMAT_*``
variables (what :func:`remat_plugin.integrations.accelerate.prepare` reads) and replaces itself
with ``accelerate launch`` and the remaining arguments, run by this Python, so the environment's
Accelerate is the one used.  The remat options come first: everything from the first other
argument on belongs to ``accelerate launch`` and the script.

Usage errors are one line each (``remat plan: error: ...``), exit code 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from remat_plugin.cli.plan_commands import add_plan_parser, add_report_parser, run_plan, run_report
from remat_plugin.errors import OptionError
from remat_plugin.planning.menus import DEFAULT_ILP_TIME_LIMIT_S
from remat_plugin.runtime.budget import BUDGET_FORMS, parse_budget
from remat_plugin.runtime.config import ENV_VARIABLES, RematConfig

# remat launch option -> RematConfig field; each is passed on as its variable, ENV_VARIABLES[field].
LAUNCH_OPTIONS = {"--budget": "budget", "--seq-bucket": "seq_bucket", "--cache-dir": "cache_dir",
                  "--ilp-time-limit-s": "ilp_time_limit_s"}
_FLAGS = {field: flag for flag, field in LAUNCH_OPTIONS.items()}


_UNIT_WORDS = {"b", "kb", "mb", "gb", "tb", "kib", "mib", "gib", "tib", "k", "m", "g"}


class OneLineParser(argparse.ArgumentParser):
    """argparse with usage errors on one line (and a hint when a budget was split in two words)."""

    def error(self, message: str):  # type: ignore[override]
        if "unrecognized arguments" in message and any(w.lower() in _UNIT_WORDS for w in message.split()[2:]):
            message += f" (a budget is one word: '12GiB', not '12 GiB'; give {BUDGET_FORMS})"
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="remat", description="remat_plugin: planned activation rematerialization.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineParser)
    add_plan_parser(commands)
    add_report_parser(commands)
    launch = commands.add_parser(
        "launch", help="run `accelerate launch` with remat on",
        usage="remat launch --budget BUDGET [remat options] [accelerate launch options] script.py [script args]",
        description="Validate the remat options, export them as REMAT_* variables, then exec `accelerate launch` "
                    "with the remaining arguments. The remat options must come before the others.")
    launch.add_argument("--budget", required=True, help="what one training step may add to allocated memory: "
                                                        + BUDGET_FORMS.replace("%", "%%"))
    launch.add_argument("--seq-bucket", help="how sequence lengths round up into plan buckets: pow2 (default), a "
                                             "multiple such as 64, or exact")
    launch.add_argument("--cache-dir", help="also keep plans in this directory, for later runs of the same model")
    launch.add_argument("--ilp-time-limit-s", type=float, help=f"wall-clock safety net of each block ILP solve, seconds (default {DEFAULT_ILP_TIME_LIMIT_S}; solves stop on counts of work first)")
    return parser


def split_launch_args(tokens: Sequence[str]) -> tuple[list[str], list[str]]:
    """The leading remat options (and ``-h``) of ``remat launch``, and the rest, for ``accelerate launch``."""
    i = 0
    while i < len(tokens):
        name = tokens[i].split("=", 1)[0]
        if name in ("-h", "--help"):
            i += 1
        elif name in LAUNCH_OPTIONS:
            i += 1 if "=" in tokens[i] else 2
        else:
            break
    return list(tokens[:i]), list(tokens[i:])


def launch_env(args: argparse.Namespace) -> dict[str, str]:
    """The ``REMAT_*`` variables for ``args``, checked together the way the training script will read them.

    Raises :class:`~remat_plugin.errors.OptionError` naming the option, the variable's text and what is accepted.
    """
    env = {ENV_VARIABLES[field]: str(getattr(args, field)) for field in LAUNCH_OPTIONS.values()
           if getattr(args, field) is not None}
    if not args.budget.strip():  # the script would read a blank REMAT_BUDGET as unset and train without remat
        parse_budget(args.budget)  # raises, naming the accepted forms
    RematConfig.from_env(env)
    return env


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    rest: list[str] = []  # launch: what goes on to `accelerate launch`
    if argv and argv[0] == "launch":
        ours, rest = split_launch_args(argv[1:])
        argv = ["launch", *ours]
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse printed usage or help
        return int(exc.code or 0)
    if args.command == "launch":
        return launch(args, rest)
    if args.command == "plan":
        return run_plan(args)
    if args.command == "report":
        return run_report(args)
    raise AssertionError(f"unhandled command {args.command!r}")


def launch(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        env = launch_env(args)
    except OptionError as exc:  # said in the command's words: the flag and its value, not the variable
        where = f"{_FLAGS[exc.option]} {exc.value!r}: " if exc.option in _FLAGS else ""
        print(f"remat launch: error: {where}{exc.detail}", file=sys.stderr)
        return 2
    if not rest:
        print("remat launch: error: no training script; usage: remat launch --budget BUDGET [accelerate launch "
              "options] script.py [script args]", file=sys.stderr)
        return 2
    os.environ.update(env)
    command = [sys.executable, "-m", "accelerate.commands.launch", *rest]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(command[0], command)
    return 0  # not reached: exec replaces this process

