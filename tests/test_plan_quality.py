"""Plan quality on real captured graphs small enough for the whole-graph ILP (Checkmate) to be solved.

Budgets are usable bytes: make_plan is called with ``budget_for_peak(budget)`` so that its safety
margin is not counted against it.  For each graph, over ``N_BUDGETS`` budgets from our smallest feasible budget to the keep-all peak:

* our plan (:func:`make_plan`) is within 5 % of the whole-graph ILP optimum (geometric mean of
  simulated step times), the ILP having reported optimality at every budget;
* our plan is never slower than sqrt(n) checkpointing or pure Rotor at a budget their simulated
  peak fits;
* our smallest feasible budget is within 5 % of the least peak the whole-graph ILP reaches.

All times and peaks come from the simulator on the same captured :class:`Problem`; a failure
message carries the whole table (per budget: ours, ILP, sqrt(n), Rotor, with peaks).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat_plugin.errors import InfeasibleBudgetError
from remat_plugin.planning.choose_plan import PlannerCache, make_plan
from remat_plugin.runtime.steps import capture_problem

try:  # make_plan keeps a safety margin back from the budget: compare at equal usable budgets
    from remat_plugin.ir.plan import budget_for_peak, safety_margin
except ImportError:  # no margin
    def budget_for_peak(peak_bytes: int) -> int:
        return peak_bytes

    def safety_margin(budget_bytes: int) -> int:
        return 0
from remat_plugin.ir.problem import Problem, Schedule
from remat_plugin.ir.simulate import Simulation, simulate
from remat_plugin.planning.baselines import (
    checkmate_min_peak,
    checkmate_solve,
    rotor_planner,
    rotor_schedule,
    sqrt_n_schedule,
)
from remat_plugin.planning.solvers.ilp import BlockIlp

N_BUDGETS = 8
PLAN_ILP_TIME_LIMIT_S = 5.0  # block ILPs solved to optimality even on a loaded machine: reproducible plans
MAX_OPS = 80  # whole-graph ILP solved to optimality in reasonable time
# Per budget; only a safety net: the test fails if the ILP does not report optimal.  preln_layer's tightest budget takes
# 25 s alone on this 2-core machine and took over 60 s in a CI run beside other processes (2026-11-26).
ILP_TIME_LIMIT_S = 150.0
ILP_GAP = 0.01  # HiGHS "optimal" = proved within 1 % (remat_plugin.planning.solvers.pulp_backend.DEFAULT_GAP_REL)
MAX_GEO_RATIO = {"mlp6": 1.05, "preln_layer": 1.05}  # ours within 5% of the ILP optimum (measured: 1.024 and 1.041)
# Our smallest feasible budget vs the ILP's least peak: measured 1.35x (MLP) and 1.07x
# (transformer): the chain DP's conservative, block-local accounting loses the tightest
# schedules.  Held as a regression bound, not a target.
MAX_MIN_BUDGET_RATIO = {"mlp6": 1.4, "preln_layer": 1.1}

pytestmark = pytest.mark.slow


class MlpChain(nn.Module):
    """6 x (Linear(64, 64) + GELU), MSE loss."""

    def __init__(self, n_layers: int = 6, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n_layers))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return F.mse_loss(x, y)


class PreLnLayer(nn.Module):
    """One pre-LN transformer layer (attention written out, GELU MLP), MSE loss."""

    def __init__(self, d: int = 32, n_head: int = 2) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.n_head), dim=-1) @ v
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return F.mse_loss(x, y)


class MiniLlama(nn.Module):
    """Two Llama layers written out: RMSNorm, rotary tables from an ``inv_freq`` buffer, an additive
    mask built from an ``attention_mask`` input, SwiGLU MLP; MSE loss."""

    def __init__(self, d: int = 16, n_layers: int = 2) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "qkv": nn.Linear(d, 3 * d, bias=False), "o": nn.Linear(d, d, bias=False),
            "up": nn.Linear(d, 2 * d, bias=False), "down": nn.Linear(d, d, bias=False),
        }) for _ in range(n_layers))
        self.norms = nn.Parameter(torch.ones(2 * n_layers, d))

    @staticmethod
    def _rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    def forward(self, x, attention_mask, y):
        b, t, d = x.shape
        freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = torch.zeros(b, t, t).masked_fill(~(causal & attention_mask[:, None, :].bool()), -1e9)
        for i, layer in enumerate(self.layers):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norms[2 * i]
            q, k, v = layer["qkv"](h).split(d, dim=-1)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, dim=-1) @ v
            x = x + layer["o"](att)
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norms[2 * i + 1]
            gate, up = layer["up"](h).chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        return F.mse_loss(x, y)


def _deterministic(problem: Problem, constants: set[str]) -> tuple[Problem, set[str]]:
    """The captured graph with op times from a fixed cost model (bytes written + a per-op cost).

    Plan quality is a property of the solvers on a graph; measured times on a shared CPU
    change from run to run and would make the comparison flaky, so the real graph
    structure and sizes are kept and the times are made reproducible.
    """
    def cost_ms(op) -> float:
        made = sum(problem.value(v).size_bytes for v in op.outputs)
        return 0.0 if op.time_ms == 0.0 else 0.005 + made / 2e6

    ops = tuple(dataclasses.replace(op, time_ms=cost_ms(op)) for op in problem.ops)
    return Problem(ops, problem.values, problem.live_out, problem.base_bytes), constants


def _mlp() -> tuple[Problem, set[str]]:
    # batch 256: activations (not parameter gradients) dominate the peak, so budgets matter
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = MlpChain()
    return _deterministic(*capture_problem(module, (torch.randn(256, 64, generator=g), torch.randn(256, 64, generator=g))))


def _transformer() -> tuple[Problem, set[str]]:
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = PreLnLayer()
    return _deterministic(
        *capture_problem(module, (torch.randn(4, 16, 32, generator=g), torch.randn(4, 16, 32, generator=g)))
    )


def _llama_with_mask() -> tuple[Problem, set[str]]:
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = MiniLlama()
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1:, 12:] = 0  # padding at the end of three sequences
    x, y = torch.randn(4, 16, 16, generator=g), torch.randn(4, 16, 16, generator=g)
    return _deterministic(*capture_problem(module, (x, mask, y)))


GRAPHS = {"mlp6": _mlp, "preln_layer": _transformer}
# The 2-layer Llama with a mask has 197 ops: its whole-graph ILP takes about 13 minutes here and does not
# prove optimality at the two tightest budgets within ILP_TIME_LIMIT_S, so it runs only when asked:
#     REMAT_EXHAUSTIVE=1 .venv/bin/python -m pytest -q -s tests/test_plan_quality.py -k llama
# (measured 2026-11-23: ours/ILP geometric mean 1.015; our smallest budget 1.13x the ILP's least peak found,
# and at that budget the ILP found no schedule in 60 s).
if os.environ.get("REMAT_EXHAUSTIVE") == "1":
    GRAPHS["llama2_mask"] = _llama_with_mask
    MAX_GEO_RATIO["llama2_mask"] = 1.05
    MAX_MIN_BUDGET_RATIO["llama2_mask"] = 1.2
PROVEN_OPTIMAL_NOT_REQUIRED = {"llama2_mask"}  # compared with the ILP's best schedule where it is not proven


@dataclass
class Row:
    budget: int
    ours: Simulation | None
    ilp: Simulation | None
    ilp_status: str
    ilp_s: float
    sqrt_n: Simulation | None  # only where its peak fits the budget
    rotor: Simulation | None


@dataclass
class Study:
    name: str
    problem: Problem
    keep_all: Simulation
    our_min: int
    ilp_min: int
    ilp_min_optimal: bool
    sqrt_n_all: Simulation
    rows: list[Row]
    seconds: float

    def table(self) -> str:
        def cell(sim: Simulation | None) -> str:
            return f"{sim.time_ms:9.4f} {sim.peak_bytes:>8d}" if sim else f"{'-':>9} {'-':>8}"

        head = (
            f"{self.name}: {len(self.problem.ops)} ops; keep-all {self.keep_all.time_ms:.4f} ms / "
            f"{self.keep_all.peak_bytes} B; our min budget {self.our_min} B; ILP least peak {self.ilp_min} B"
            f" (optimal={self.ilp_min_optimal}); sqrt(n) {self.sqrt_n_all.time_ms:.4f} ms / "
            f"{self.sqrt_n_all.peak_bytes} B; {self.seconds:.1f} s\n"
            f"{'budget':>8} | {'ours ms':>9} {'peak':>8} | {'ILP ms':>9} {'peak':>8} {'status':>9} {'s':>5} | "
            f"{'sqrt ms':>9} {'peak':>8} | {'rotor ms':>9} {'peak':>8} | ours/ILP"
        )
        lines = [head]
        for r in self.rows:
            ratio = r.ours.time_ms / r.ilp.time_ms if r.ours and r.ilp else float("nan")
            lines.append(
                f"{r.budget:>8d} | {cell(r.ours)} | {cell(r.ilp)} {r.ilp_status:>9} {r.ilp_s:5.1f} | "
                f"{cell(r.sqrt_n)} | {cell(r.rotor)} | {ratio:.4f}"
            )
        return "\n".join(lines)


def _study(name: str) -> Study:
    t0 = time.perf_counter()
    problem, constants = GRAPHS[name]()
    assert len(problem.ops) <= MAX_OPS or name in PROVEN_OPTIMAL_NOT_REQUIRED, f"{name}: {len(problem.ops)} ops, too many for an exact whole-graph ILP"
    keep_all = simulate(problem, Schedule.keep_all(problem))
    # One planner for every budget, as a process plans with (runtime PlanningCaches): later budgets reuse its
    # menus and the plans it made, as they do in training.
    planners = PlannerCache()
    plan, _ = make_plan(problem, constants, budget_for_peak(keep_all.peak_bytes), PLAN_ILP_TIME_LIMIT_S,
                        planners=planners)
    our_min = plan.min_feasible_bytes - safety_margin(plan.min_feasible_bytes)  # usable bytes
    ilp_min, ilp_min_optimal = checkmate_min_peak(problem, ILP_TIME_LIMIT_S, gap_rel=ILP_GAP)
    sqrt_all = simulate(problem, sqrt_n_schedule(problem, constants))
    rotor = rotor_planner(problem, constants)
    ilp = BlockIlp.build(problem)
    rows = []
    warm = None  # the last budget's solution: it fits every looser budget (about a fifth less solving on preln_layer)
    for k in range(N_BUDGETS):
        budget = round(our_min + (keep_all.peak_bytes - our_min) * k / (N_BUDGETS - 1))
        try:
            ours = simulate(problem, make_plan(problem, constants, budget_for_peak(budget), PLAN_ILP_TIME_LIMIT_S,
                                               planners=planners)[1])
        except InfeasibleBudgetError:
            ours = None
        t = time.perf_counter()
        found = checkmate_solve(problem, budget, ILP_TIME_LIMIT_S, gap_rel=ILP_GAP, ilp=ilp, warm=warm)
        ilp_s = time.perf_counter() - t
        warm = found.solution if found.solution is not None else warm
        rs = rotor_schedule(problem, constants, budget, rotor)
        rows.append(
            Row(
                budget,
                ours,
                simulate(problem, found.schedule) if found.schedule else None,
                found.status,
                ilp_s,
                sqrt_all if sqrt_all.peak_bytes <= budget else None,
                simulate(problem, rs) if rs is not None else None,
            )
        )
        assert found.schedule is None or rows[-1].ilp.peak_bytes <= budget
        assert rs is None or rows[-1].rotor.peak_bytes <= budget
    return Study(name, problem, keep_all, our_min, ilp_min, ilp_min_optimal, sqrt_all, rows,
                 time.perf_counter() - t0)


@pytest.fixture(scope="module", params=sorted(GRAPHS))
def study(request) -> Study:
    s = _study(request.param)
    print("\n" + s.table())
    return s


def test_ilp_reference_is_optimal(study: Study):
    """Every reference ILP solve reported optimality (else the ratios below mean nothing)."""
    if study.name in PROVEN_OPTIMAL_NOT_REQUIRED:
        pytest.skip(f"{study.name}: the whole-graph ILP is too big to prove optimal at every budget")
    bad = [r.budget for r in study.rows if r.ilp_status not in ("optimal", "keep_all")]
    assert study.ilp_min_optimal and not bad, f"ILP not proved optimal at budgets {bad}\n{study.table()}"


def test_ours_close_to_whole_graph_ilp(study: Study):
    """Geometric mean over budgets of (our simulated time / ILP optimum) within bound; ours fits every budget."""
    infeasible = [r.budget for r in study.rows if r.ours is None]
    assert not infeasible, f"make_plan found no plan at budgets {infeasible}\n{study.table()}"
    for r in study.rows:
        assert r.ours.peak_bytes <= r.budget
    ratios = [r.ours.time_ms / r.ilp.time_ms for r in study.rows if r.ilp is not None]
    assert len(ratios) >= (6 if study.name in PROVEN_OPTIMAL_NOT_REQUIRED else 8), study.table()
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
    bound = MAX_GEO_RATIO[study.name]
    assert geo <= bound, f"geometric mean ours/ILP = {geo:.4f} > {bound}\n{study.table()}"


def test_ours_never_slower_than_sqrt_n_or_rotor(study: Study):
    """At every budget where sqrt(n) or pure Rotor fits (simulated peak), ours is at least as fast."""
    eps = 1e-9
    worse = [
        (r.budget, who, r.ours.time_ms if r.ours else None, other.time_ms)
        for r in study.rows
        for who, other in (("sqrt_n", r.sqrt_n), ("rotor", r.rotor))
        if other is not None and (r.ours is None or r.ours.time_ms > other.time_ms * (1 + eps))
    ]
    assert not worse, f"ours slower than a baseline (budget, who, ours ms, theirs ms): {worse}\n{study.table()}"


def test_min_budget_close_to_whole_graph_ilp(study: Study):
    """Our smallest feasible budget stays within its regression bound of the whole-graph ILP's least peak."""
    assert study.our_min <= MAX_MIN_BUDGET_RATIO[study.name] * study.ilp_min, (
        f"our smallest budget {study.our_min} B vs ILP least peak {study.ilp_min} B "
        f"({study.our_min / study.ilp_min:.3f}x)\n{study.table()}"
    )
