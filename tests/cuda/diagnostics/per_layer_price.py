"""Our plan against per-layer checkpointing in our own cost model: `python tests/cuda/diagnostics/per_layer_price.py
[cuda|cpu] [model] [budget fractions...]` (default: cuda, gpt2-small, 0.38 0.42 0.5).

On the H200, GPT-2 small at 0.38-0.42 of its peak planned 1.35-1.45x where per-layer checkpointing measured 1.26x
(README, Known limits, GPU).  This captures the step once (logits held without a gradient, as a first plan that
steps down runs it), prices checkpointing every block, every two blocks (a GPT-2 layer is two blocks: attention,
MLP) and sqrt(n) segments with the simulator, and plans at each budget: if a checkpointing schedule fits a budget
at a lower predicted time than our plan there, the planner misses it; if none fits, the model prices
checkpointing above the allocator's measurement of the peer.  These segments recompute the LM head and the loss too,
which transformers' per-layer checkpointing does not: their times are an upper bound of the peer's.
On this CPU (`cpu gpt2-tiny 0.3 0.5`, 2026-11-28): every block 0.23 of the peak at 1.52x; ours 1.22x at 0.3 and
1.10x at 0.5, no checkpointing schedule faster."""
import sys

from remat_plugin.bench.models import build
from remat_plugin.errors import InfeasibleBudgetError
from remat_plugin.ir.problem import Schedule
from remat_plugin.ir.simulate import simulate
from remat_plugin.planning.baselines import segmented_schedule, sqrt_n_segments
from remat_plugin.planning.choose_plan import make_plan
from remat_plugin.planning.menus import Planner
from remat_plugin.runtime.steps import captured_problem

DEV = sys.argv[1] if len(sys.argv) > 1 else "cuda"
NAME = sys.argv[2] if len(sys.argv) > 2 else "gpt2-small"
FRACTIONS = [float(f) for f in sys.argv[3:]] or [0.38, 0.42, 0.5]
GiB = 2**30


bench = build(NAME, device=DEV)
args, kwargs = bench.make_batch(0)
captured = captured_problem(bench.module, args, kwargs, ungrade_beside_the_loss=True)
problem, constants = captured.problem, captured.constants
base = simulate(problem, Schedule.keep_all(problem))
planner = Planner(problem, constants)
planner.prepare()
blocks = planner.blocks
n = len(blocks)
print(f"{NAME} on {DEV}: {n} blocks, keep-all {base.peak_bytes / GiB:.3f} GiB, {base.time_ms:.1f} ms; outputs held "
      f"without a gradient: {sorted(captured.ungraded_outputs)}")
for i, b in enumerate(blocks):
    fwd_ms = sum(problem.op(o).time_ms for o in b.fwd_ops)
    print(f"  block {i:2d}: {len(b.fwd_ops):3d} forward ops, {fwd_ms:8.2f} ms forward")
schedules = {
    "every block": [[i] for i in range(n)],
    "every two blocks": [list(range(i, min(i + 2, n))) for i in range(0, n, 2)],
    "every two blocks, first alone": [[0]] + [list(range(i, min(i + 2, n))) for i in range(1, n, 2)],
    "sqrt(n)": sqrt_n_segments(n),
}
priced = {}
for name, segs in schedules.items():
    sim = simulate(problem, segmented_schedule(problem, blocks, segs))
    priced[name] = sim
    print(f"checkpointing {name:30s}: peak {sim.peak_bytes / GiB:.3f} GiB ({sim.peak_bytes / base.peak_bytes:.2f}), "
          f"{sim.time_ms / base.time_ms:.3f}x")
for f in FRACTIONS:
    budget = int(f * base.peak_bytes)
    try:
        plan, _ = make_plan(problem, constants, budget)
    except InfeasibleBudgetError as exc:
        print(f"budget {f}: infeasible, floor {exc.min_feasible_bytes / GiB:.3f} GiB")
        continue
    fits = [(name, sim.time_ms / base.time_ms) for name, sim in priced.items() if sim.peak_bytes <= budget]
    better = [(k, t) for k, t in fits if t < plan.predicted_overhead]
    print(f"budget {f} ({budget / GiB:.3f} GiB): ours {plan.predicted_peak_bytes / GiB:.3f} GiB at "
          f"{plan.predicted_overhead:.3f}x; checkpointing that fits: {fits or 'none'}"
          + (f"; FASTER THAN OURS: {better}" if better else ""))
    for b in plan.blocks:
        if b.mode != "keep":
            print(f"    block {b.index}: {b.mode}, recomputes {b.recompute_ms:.2f} ms")
