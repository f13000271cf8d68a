"""NOTE [old objects frozen]: planning leaves the process's older objects out of garbage collection, still frees its
own garbage, unfreezes on the way out, and leaves a process's own freeze alone."""
import gc
import threading
import weakref

import torch

from remat_plugin import rematerialize
from remat_plugin.bench.models import build
from remat_plugin.gc_freeze import old_objects_frozen


class _Node:
    pass


def _cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_inside_old_objects_are_frozen_and_new_garbage_is_still_collected():
    assert gc.get_freeze_count() == 0
    before = _Node()
    with old_objects_frozen():
        assert gc.get_freeze_count() > 0
        made_inside = _cycle()
        gc.collect()
        assert made_inside() is None  # planning's own cycles are freed while it runs
    assert gc.get_freeze_count() == 0
    assert before is not None


def test_nested_and_concurrent_planning_unfreeze_once_the_last_ends():
    entered, leave = threading.Event(), threading.Event()

    def other_planner():
        with old_objects_frozen():
            entered.set()
            leave.wait(60)

    with old_objects_frozen():
        with old_objects_frozen():
            pass
        assert gc.get_freeze_count() > 0  # the inner exit left the outer freeze
        thread = threading.Thread(target=other_planner)
        thread.start()
        assert entered.wait(60)
    assert gc.get_freeze_count() > 0  # the other thread still plans
    leave.set()
    thread.join()
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_keeps_its_freeze():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with old_objects_frozen():
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_planning_runs_its_collections_with_old_objects_frozen_and_unfreezes_after():
    bench = build("gpt2-tiny", n_layer=2, batch_size=2, seq_len=32)
    args, kwargs = bench.make_batch(0)
    seen: list[int] = []

    def record(phase, _info):
        if phase == "start":
            seen.append(gc.get_freeze_count())

    gc.callbacks.append(record)
    try:
        rm = rematerialize(bench.module, args, kwargs, budget=10**9)
    finally:
        gc.callbacks.remove(record)
    assert seen and max(seen) > 0  # collections ran during planning, the old objects frozen
    assert gc.get_freeze_count() == 0
    bench.loss(rm(*args, **kwargs)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in bench.module.parameters()
               if p.requires_grad)
