import logging
import os

import pytest
import torch

# Under pytest-xdist (`make test` runs `pytest -n 2`) the workers share the cores: each gets cores // workers torch
# threads instead of all of them, and the subprocesses its tests start inherit the same through OMP_NUM_THREADS.
# A value the caller set wins.
_XDIST = bool(os.environ.get("PYTEST_XDIST_WORKER_COUNT"))
if _XDIST:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The whole suite runs with --dist loadfile, each file on one worker: the 3 `accelerate launch` tests, which all
# listen on accelerate's default port 29500, never run at once, and a module-scoped fixture (a launch, a benchmark
# run, a plan-quality study) is built once.  The files are handed out in collection order (--no-loadscope-reorder),
# reordered here so that the longest start first and no long file is left to run alone at the end.  (xdist_group
# with --dist loadgroup groups nothing under pytest 9.2 + pytest-xdist 3.8: xdist renames item._nodeid, pytest
# reads item._id.)
_LONGEST_FIRST = ["test_model_families.py", "test_mixed_precision.py", "test_plan_quality.py", "test_fsdp.py", "test_api.py",
                  "test_lightning.py", "test_compile.py", "test_lightning_precision.py",
                  "test_accelerate_launch.py", "test_cli.py", "test_training_loop.py", "test_bench_batch_size.py",
                  "test_rank_failures.py", "test_output.py", "test_accelerate_batch_size.py", "test_bench_compare.py"]


def pytest_collection_modifyitems(config, items):
    if _XDIST:
        rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.fixture(autouse=True)
def _quiet_and_seeded():
    from remat_plugin.capture import export

    logging.getLogger("remat_plugin").setLevel(logging.WARNING)
    torch.manual_seed(0)
    # "could not be traced once" is said once per process and model and reason: a test that asserts it must not
    # find it said already by another file's test on the same worker
    export._told_whole.clear()
    yield
