"""Calls of a planned module made before an earlier call's backward (NOTE [calls in flight] in
``remat_plugin/capture/output_usage.py``): a plan holds one call at a time, so a second call beside the first's saved
tensors ran over the budget, with no word (112.08 MiB against 59.47 MiB on gpt2-tiny at 4x128 tokens, float64)."""
import copy

import pytest
import torch
from budgets import step_grads

from remat_plugin import CallsInFlightError, InfeasibleBudgetError, rematerialize
from remat_plugin.bench.models import build
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.errors import human_bytes
from remat_plugin.ir.plan import budget_for_peak


def _gpt2():
    bench = build("gpt2-tiny", dtype=torch.float64, seed=0, n_layer=2, batch_size=4, seq_len=64)
    return bench.module, copy.deepcopy(bench.module), [bench.make_batch(i)[1] for i in range(2)]


def _two_calls(module, batches, seed: int = 5):
    """One step of a loop that calls the module on both halves of its batch, then takes one backward."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    (module(**batches[0]).loss + module(**batches[1]).loss).backward()
    return [p.grad.clone() for p in module.parameters()]


def test_a_second_call_over_the_budget_is_refused_before_it_runs():
    module, _, batches = _gpt2()
    plan = rematerialize(copy.deepcopy(module), (), batches[0], budget=10**12, verbose=False).plan
    rm = rematerialize(module, (), batches[0], verbose=False,
                       budget=(budget_for_peak(plan.baseline_peak_bytes) + plan.min_feasible_bytes) // 2)
    step_grads(rm, batches)  # a loop with one call per backward runs
    first = rm(**batches[0])
    with pytest.raises(CallsInFlightError, match=r"called while 1 earlier call\(s\) of it still await backward\(\), "
                       r"holding \d+\.\d+ MiB.*over the budget.*Call backward\(\) after each call.*torch\.cat.*raise "
                       r"the budget to about (\d+\.\d+) MiB \(2 times a call's unmodified peak") as err:
        rm(**batches[1])
    assert isinstance(err.value, InfeasibleBudgetError)  # what a batch-size search or a caller already catches
    assert err.value.min_feasible_bytes > err.value.budget_bytes
    # the budget the error advises is the one test_calls_that_fit_the_budget_together_run_within_it runs at
    assert human_bytes(2 * budget_for_peak(rm.plan.baseline_peak_bytes)) in str(err.value)
    first.loss.backward()  # the first call's step is not harmed; its backward frees what it held
    step_grads(rm, batches)  # and a loop with one call per backward runs again
    del err


def test_calls_that_fit_the_budget_together_run_within_it():
    """A budget above both calls' peaks together: the step runs, measured within it, gradients bitwise eager's but
    for GPT-2's tied embedding and LM head weight, whose four contributions (two per call) eager sums as its engine
    reaches each and ours per call (3.5e-18 apart; one call per backward is bitwise)."""
    module, reference, batches = _gpt2()
    baseline = rematerialize(copy.deepcopy(module), (), batches[0], budget=10**12, verbose=False).plan
    budget = 2 * budget_for_peak(baseline.baseline_peak_bytes)
    rm = rematerialize(module, (), batches[0], budget=budget, verbose=False)
    tied = [name for name, _ in module.named_parameters()].index("transformer.wte.weight")
    for seed in range(3):
        ours, eager = _two_calls(rm, batches, seed), _two_calls(reference, batches, seed)
        assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(ours, eager)) if i != tied)
        torch.testing.assert_close(ours[tied], eager[tied], rtol=1e-12, atol=1e-15)
    module.zero_grad(set_to_none=True)
    _, peak = measure_peak_profiler(lambda: _two_calls(rm, batches))
    assert peak <= budget


def test_backward_after_each_call_is_eagers_and_within_the_budget():
    """The fix the error names: backward() after each call (a sum of losses has the same gradients), bitwise eager's;
    each call and its backward within the budget, the second one's accumulating into the first one's gradients."""
    module, reference, batches = _gpt2()
    plan = rematerialize(copy.deepcopy(module), (), batches[0], budget=10**12, verbose=False).plan
    budget = (budget_for_peak(plan.baseline_peak_bytes) + plan.min_feasible_bytes) // 2
    rm = rematerialize(module, (), batches[0], budget=budget, verbose=False)

    def each(m, seed=5):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        for batch in batches:
            m(**batch).loss.backward()
        return [p.grad.clone() for p in m.parameters()]

    for seed in range(3):
        assert all(torch.equal(a, b) for a, b in zip(each(rm, seed), each(reference, seed)))
    module.zero_grad(set_to_none=True)
    peaks = [measure_peak_profiler(lambda batch=batch: rm(**batch).loss.backward())[1] for batch in batches]
    assert max(peaks) <= budget, (peaks, budget)


def test_a_graph_the_caller_dropped_holds_nothing():
    """A call whose outputs were dropped without backward (a metric computed in training mode) is not in flight."""
    module, _, batches = _gpt2()
    plan = rematerialize(copy.deepcopy(module), (), batches[0], budget=10**12, verbose=False).plan
    rm = rematerialize(module, (), batches[0], verbose=False,
                       budget=(budget_for_peak(plan.baseline_peak_bytes) + plan.min_feasible_bytes) // 2)
    step_grads(rm, batches)
    rm(**batches[0])  # its graph is freed as the output goes
    step_grads(rm, batches)
