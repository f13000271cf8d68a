import logging
import os

import pytest
import torch

# Under pytest-xdist (`make test` runs `pytest -n 2 --dist loadgroup`) the workers share the cores: each gets
# cores // workers torch threads instead of all of them, and the subprocesses its tests start inherit the same
# through OMP_NUM_THREADS.  A value the caller set wins.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, len(os.sched_getaffinity(0)) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# With --dist loadgroup, the tests of one group run on one worker, one after the other:
# - "launch": every test that starts `accelerate launch`/`remat launch`, which listen on accelerate's fixed default
#   port (29500); two at once on two workers would collide.
# - a file whose module-scoped fixture is expensive (a launch, a benchmark subprocess, a plan-quality study) runs on
#   one worker so that the fixture is built once, not once per worker; a parametrized one per parameter.
_GROUPS = {
    "test_accelerate_launch.py": "launch",
    "test_bench_cli.py": "bench_cli",
    "test_bench_compare.py": "bench_compare",
    "test_output.py": "output",  # its subprocess runs are cached per process (functools.cache)
    "test_plan_quality.py": "plan_quality",
}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = _GROUPS.get(item.path.name)
        if group is None:
            continue
        param = getattr(item, "callspec", None) and item.callspec.params.get("study")
        item.add_marker(pytest.mark.xdist_group(f"{group}-{param}" if param else group))


@pytest.fixture(autouse=True)
def _quiet_and_seeded():
    logging.getLogger("remat_plugin").setLevel(logging.WARNING)
    torch.manual_seed(0)
    yield
