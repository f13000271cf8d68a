"""The ``remat`` command line: ``plan``, ``report`` and ``launch``."""
from remat_plugin.cli.main import build_parser, launch_env, main, split_launch_args

__all__ = ["build_parser", "launch_env", "main", "split_launch_args"]
