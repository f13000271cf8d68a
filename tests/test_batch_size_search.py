"""The batch-size search captures each size without running its step: no capture spends the memory it measures."""
from __future__ import annotations

import pytest
import torch

from remat_plugin.batch_size.search import choose_batch_size, scale_inputs
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.ir.problem import Schedule
from remat_plugin.ir.simulate import simulate
from remat_plugin.runtime.steps import capture_problem

pytest.importorskip("transformers")
from remat_plugin.bench.models import build


def _gpt2():
    bm = build("gpt2-tiny", n_layer=2, batch_size=8, seq_len=128)
    return bm, *bm.make_batch(0)


def _keep_all_peak(bm, args, kwargs) -> int:
    def step():
        bm.loss(bm.module(*args, **kwargs)).backward()

    peak = measure_peak_profiler(step)[1]
    bm.module.zero_grad(set_to_none=True)
    return peak


def test_a_capture_runs_no_step_and_leaves_rng_and_grads_alone():
    bm, args, kwargs = _gpt2()
    a2, k2 = scale_inputs(args, kwargs, 8, 16)
    step_peak = _keep_all_peak(bm, a2, k2)
    rng = torch.get_rng_state()
    (problem, _), peak = measure_peak_profiler(lambda: capture_problem(bm.module, a2, k2))
    assert peak < 0.25 * step_peak, (peak, step_peak)  # one op at a time, never the step's activations
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in bm.module.parameters())
    # what was captured is the step: the unmodified schedule's simulated peak is the measured one within 5%
    simulated = simulate(problem, Schedule.keep_all(problem)).peak_bytes
    assert abs(simulated - step_peak) <= 0.05 * step_peak, (simulated, step_peak)


def test_the_search_stays_within_the_budget_it_plans_for():
    """A budget the unmodified step at twice the first batch would exceed: the whole search, metered at the
    allocator, stays within it (it captured that size, and planned a larger one, without running either)."""
    bm, args, kwargs = _gpt2()
    budget = int(0.8 * _keep_all_peak(bm, args, kwargs))
    choice, peak = measure_peak_profiler(lambda: choose_batch_size(bm.module, args, kwargs, budget, multiple_of=4))
    assert peak <= budget, (peak, budget)
    assert choice.batch_size >= 8


def test_sizes_beside_a_loss_are_planned_as_the_first_plan_steps_down():
    """A module returning its loss beside logits: each size is planned with the logits held without a gradient,
    as training's first plan steps down to when nothing fits with them differentiated (NOTE [loss-only first
    plan]).  The chosen size has no plan with the logits differentiated, so a keep-all search stops lower; run
    there, its step stays within the budget, its gradients are the unmodified module's, and a loop that
    differentiates the logits is refused before any gradient is computed."""
    import copy

    from model_factories import TinyLM

    from remat_plugin.errors import InfeasibleBudgetError
    from remat_plugin.planning.choose_plan import make_plan
    from remat_plugin.runtime.module import rematerialize
    from remat_plugin.runtime.steps import captured_problem

    torch.manual_seed(0)
    model = TinyLM()
    budget = 20 * 2**20
    ids, labels = torch.randint(0, 2048, (4, 64)), torch.randint(0, 2048, (4, 64))
    choice = choose_batch_size(model, (ids, labels), {}, budget)
    assert choice.ungraded_outputs == (1,) and "held without a gradient" in choice.summary()
    size = choice.batch_size
    ids, labels = torch.randint(0, 2048, (size, 64)), torch.randint(0, 2048, (size, 64))
    keep_all = captured_problem(model, (ids, labels))
    assert keep_all.ungraded_outputs == frozenset()
    with pytest.raises(InfeasibleBudgetError):
        make_plan(keep_all.problem, keep_all.constants, budget, 1.0)

    reference = copy.deepcopy(model)
    reference(ids, labels)[0].backward()
    planned = rematerialize(model, (ids, labels), budget=budget, verbose=False)
    assert planned.plan is not None and planned.plan.ungraded_outputs == (1,)

    def held_step():
        loss, logits = planned(ids, labels)
        loss.backward()  # the logits held through backward(), given no gradient
        return logits

    logits, peak = measure_peak_profiler(held_step)
    assert peak <= budget, (peak, budget)
    assert logits.shape == (size, 64, 2048)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    loss, logits = planned(ids, labels)
    with pytest.raises(InfeasibleBudgetError, match="gradient"):
        (loss + logits.float().mean()).backward()
