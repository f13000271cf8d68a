"""Calibration (NOTE [calibration] in remat_plugin.runtime.calibration): a new plan is metered at the allocator
before the caller's step runs it; a peak above the prediction goes into the next plan as bytes kept back, at most
twice, logged -- so the caller's steps stay within the budget even when the model misses memory."""
from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from budgets import assert_same_grads_and_buffers
from torch import nn

from remat_plugin import rematerialize
from remat_plugin.capture.memory_meter import measure_peak_profiler
from remat_plugin.errors import InfeasibleBudgetError
from remat_plugin.ir.problem import Problem
from remat_plugin.runtime import calibration, resolver, steps


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(256, 1)).double().train(), torch.randn(512, 256, dtype=torch.float64)


def _step(module, reference, x, seed: int, allocator: bool = False) -> int | None:
    """One step of ``module`` and ``reference`` on the same dropout masks, gradients compared; with
    ``allocator``, ``module``'s peak by the CPU allocator (a profiler session defers calibration)."""
    for m in (module, reference):
        for p in m.parameters():
            p.grad = None

    def run():
        torch.manual_seed(seed)
        module(x).square().mean().backward()

    peak = measure_peak_profiler(run)[1] if allocator else run()
    torch.manual_seed(seed)
    reference(x).square().mean().backward()
    assert_same_grads_and_buffers(module, reference, f"step {seed}")
    return peak


def _underestimated(scale: float):
    """``measured_problem`` with every value's size scaled down: a model that misses memory."""
    real = steps.measured_problem

    def measured_problem(*args, **kwargs) -> tuple[Problem, set[str]]:
        problem, constants = real(*args, **kwargs)
        values = tuple(dataclasses.replace(v, size_bytes=int(v.size_bytes * scale)) for v in problem.values)
        return dataclasses.replace(problem, values=values), constants

    return measured_problem


def test_a_model_that_misses_memory_is_corrected_before_any_step_runs_over(monkeypatch, caplog):
    module, x = _mlp()
    reference = copy.deepcopy(module)
    unmodified = rematerialize(copy.deepcopy(module), (x,), budget=10**12, verbose=False).plan
    budget = int(0.6 * unmodified.baseline_peak_bytes)
    monkeypatch.setattr(steps, "measured_problem", _underestimated(0.75))
    metered: list[int] = []
    meter = calibration.metered_step

    def recording(*args):
        metered.append(meter(*args))
        return metered[-1]

    monkeypatch.setattr(resolver, "metered_step", recording)
    rm = rematerialize(module, (x,), budget=budget, verbose=False)
    first = rm.plan
    with caplog.at_level(logging.INFO, logger="remat_plugin"):
        _step(rm, reference, x, 0)  # metered before it runs (no meter of ours around it: sessions do not nest)
    corrections = rm._resolver.calibration.corrections[next(iter(rm.steps))]
    assert metered[0] > budget  # the first plan would have run over ...
    assert 1 <= len(corrections) <= calibration.MAX_OVER_BUDGET_CORRECTIONS and metered[-1] <= budget  # ... the step
    assert "calibration: measured peak" in caplog.text and "correction 1 of 4" in caplog.text  # ran this one
    assert rm.plan is not first and rm.plan.margin_bytes >= first.margin_bytes + corrections[0]
    peaks = [_step(rm, reference, x, seed, allocator=True) for seed in range(1, 4)]
    assert all(peak <= budget for peak in peaks), (budget, peaks)
    assert len(metered) == len(corrections) + 1  # nothing metered once settled


def test_a_plan_that_keeps_metering_over_the_budget_raises_and_no_step_runs(monkeypatch):
    """Every plan metered over the budget: corrected up to MAX_OVER_BUDGET_CORRECTIONS times, then the call raises
    InfeasibleBudgetError naming the metered peak, and the caller's step never runs (no gradient is made)."""
    module, x = _mlp()
    unmodified = rematerialize(copy.deepcopy(module), (x,), budget=10**12, verbose=False).plan
    budget = int(0.85 * unmodified.baseline_peak_bytes)  # room for every correction
    metered: list[int] = []

    def over_budget(*_args):
        metered.append(budget + 1024)  # just over: each correction is small, and a plan is always found
        return metered[-1]

    monkeypatch.setattr(resolver, "metered_step", over_budget)
    rm = rematerialize(module, (x,), budget=budget, verbose=False)
    with pytest.raises(InfeasibleBudgetError, match="metered"):
        rm(x).square().mean().backward()
    assert 2 <= len(metered) <= calibration.MAX_OVER_BUDGET_CORRECTIONS + 1
    assert all(p.grad is None for p in module.parameters())


def test_an_accurate_prediction_is_metered_once_and_left_alone(caplog):
    module, x = _mlp()
    reference = copy.deepcopy(module)
    unmodified = rematerialize(copy.deepcopy(module), (x,), budget=10**12, verbose=False).plan
    budget = int(0.6 * unmodified.baseline_peak_bytes)
    rm = rematerialize(module, (x,), budget=budget, verbose=False)
    plan = rm.plan
    with caplog.at_level(logging.INFO, logger="remat_plugin"):
        _step(rm, reference, x, 0)
    peaks = [_step(rm, reference, x, seed, allocator=True) for seed in range(1, 4)]
    assert rm.plan is plan and rm._resolver.calibration.corrections[next(iter(rm.steps))] == []
    assert "calibration" not in caplog.text
    assert all(peak <= budget for peak in peaks)
    assert not any(step.to_meter for step in rm.steps.values())
