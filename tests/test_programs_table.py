"""kept_values on real joint graphs of tiny MLPs: what the forward program saves for each schedule."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from remat_plugin.capture.export import build_step
from remat_plugin.capture.joint import JointGraph
from remat_plugin.capture.programs import emit_programs, kept_values
from remat_plugin.ir.problem import Schedule
from remat_plugin.ir.simulate import simulate
from remat_plugin.planning.menus import kept_reads

# The joint graphs, read once (torch 2.x AOTAutograd naming).  Placeholders: primals_1 = W1 (8x4),
# primals_2 = b1, primals_3 = W2 (2x8), primals_4 = b2, primals_5 = x (3x4), tangents_1 = grad of the
# output (3x2).  Views (t, detach, view) are folded into their base value.
#
# "mlp" = Linear(4, 8), ReLU, Linear(8, 2).  Forward: addmm (h = x W1^T + b1), relu, addmm_1 (output,
# live_out).  Backward, in order: mm = tangents @ W2 (reads primals_3 through t_2 -> t_1),
# mm_1 = tangents^T @ relu (grad W2), sum_1 (grad b2), threshold_backward(mm, relu),
# mm_2 = threshold_backward^T @ x (grad W1, reads primals_5), sum_2 (grad b1).
#
# "dropout_mlp" adds Dropout(0.5) after the ReLU, captured as its mask and a multiply (NOTE [dropout masks]):
# dropout_mask_default (random, reads relu for its layout) makes the mask (3x8 bool, 24 B) and apply_dropout_mask_default
# reads relu and the mask and makes the output (3x8 float); addmm_1 and mm_1 read that output;
# its backward dropout_mask_backward_default(mm, mask) comes before threshold_backward(that, relu).
MLP_BWD = ("__tangents__", "mm", "mm_1", "sum_1", "threshold_backward", "mm_2", "sum_2")
DROP_MASK, DROP_OUT = "dropout_mask_default", "apply_dropout_mask_default"
DROP_BWD = ("__tangents__", "mm", "mm_1", "sum_1", "dropout_mask_backward_default", "threshold_backward", "mm_2", "sum_2")


def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 2))


def capture(name: str) -> JointGraph:
    """The joint graph of ``name`` on a 3x4 input, as build_step hands it to the partitioner."""
    found: dict[str, JointGraph] = {}

    def emit(joint: JointGraph):
        found["joint"] = joint
        return emit_programs(joint, Schedule.keep_all(joint.to_problem({}, {})))

    x = torch.randn(3, 4)
    build_step(make_model(name), (x,), {}, emit, torch.device("cpu"))((x,), {})
    return found["joint"]


def _with(seq: tuple[str, ...], before: str, inserted: tuple[str, ...]) -> tuple[str, ...]:
    i = seq.index(before)
    return seq[:i] + inserted + seq[i:]


# (model, backward sequence, kept values in first-read order, simulated kept bytes)
CASES = {
    # keep-all: mm reads W2 (primals_3); mm_1 reads relu; sum_1 only the tangent (never kept);
    # threshold_backward reads mm (made) and relu (already listed); mm_2 reads x (primals_5).
    # kept bytes count only problem values: relu, 3x8 float32 = 96.
    "mlp_keep_all": ("mlp", MLP_BWD, ["primals_3", "relu", "primals_5"], 96),
    # recompute the hidden layer (addmm, relu) just before mm_1: addmm reads b1, x and W1 (through t),
    # placeholders in argument order primals_2, primals_5, primals_1; relu is then made, not kept.
    # No activation is kept any more (0 bytes): only parameters and the input.
    "mlp_recompute_hidden": ("mlp", _with(MLP_BWD, "mm_1", ("addmm", "relu")),
                             ["primals_3", "primals_2", "primals_5", "primals_1"], 0),
    # recompute only relu: it reads addmm, which is kept instead of relu (same 96 bytes)
    "mlp_recompute_relu": ("mlp", _with(MLP_BWD, "mm_1", ("relu",)), ["primals_3", "addmm", "primals_5"], 96),
    # keep-all with dropout: mm_1 reads the dropout's output (96 B), dropout_mask_backward_default its mask
    # (24 B of bool), threshold_backward relu (96 B): 216 bytes; no RNG state is needed
    "dropout_keep_all": ("dropout_mlp", DROP_BWD, ["primals_3", DROP_OUT, DROP_MASK, "relu", "primals_5"], 216),
    # recompute the whole dropout before mm_1: the mask from relu (its layout) and its generator state
    # dropout_mask_default__rng (CPU state: 5056 bytes), the output from relu and that mask: 96 + 5056
    "dropout_recompute": ("dropout_mlp", _with(DROP_BWD, "mm_1", (DROP_MASK, DROP_OUT)),
                          ["primals_3", "relu", DROP_MASK + "__rng", "primals_5"], 96 + 5056),
    # recompute only the output: the mask is kept (24 B), no draw is replayed: 96 + 24
    "dropout_recompute_output": ("dropout_mlp", _with(DROP_BWD, "mm_1", (DROP_OUT,)),
                                 ["primals_3", "relu", DROP_MASK, "primals_5"], 96 + 24),
}


@pytest.mark.parametrize("name", CASES)
def test_kept_values(name: str) -> None:
    """kept_values lists what the backward reads before recomputing it, in first-read order."""
    model, seq, expected, kept_bytes = CASES[name]
    joint = capture(model)
    problem = joint.to_problem({}, {})
    assert tuple(o.name for o in problem.bwd_ops) == (MLP_BWD if model == "mlp" else DROP_BWD)
    schedule = Schedule(seq)
    kept = kept_values(joint, schedule)
    assert kept == expected
    # the non-placeholder part is the problem-level kept set, and the simulator prices it the same
    placeholders = {n.name for n in joint.gm.graph.nodes if n.op == "placeholder"}
    assert {v for v in kept if v not in placeholders} == kept_reads(problem, schedule)
    assert simulate(problem, schedule).kept_bytes == kept_bytes


@pytest.mark.parametrize("name", ["mlp_keep_all", "mlp_recompute_hidden", "dropout_recompute",
                                  "dropout_recompute_output"])
def test_forward_program_saves_kept_values(name: str) -> None:
    """The emitted forward program returns the model output plus exactly the kept values."""
    model, seq, expected, _ = CASES[name]
    joint = capture(model)
    fw, bw = emit_programs(joint, Schedule(seq))
    fw_out = fw.graph.find_nodes(op="output")[0].args[0]
    assert len(fw_out) == joint.num_fwd_outputs + len(expected) == 1 + len(expected)
    saved = [n.name for n in fw_out[joint.num_fwd_outputs:]]
    # a recomputed random op saves a capture_rng_state node in place of the "__rng" value
    rng = [n for n in fw.graph.nodes if n.op == "call_function" and n.target.__name__ == "capture_rng_state"]
    assert len(rng) == sum(v.endswith("__rng") for v in expected)
    assert saved == [rng[0].name if v.endswith("__rng") else v for v in expected]
    bw_inputs = [n.name for n in bw.graph.find_nodes(op="placeholder")]
    assert bw_inputs[: len(saved)] == saved and bw_inputs[len(saved):] == ["tangents_1"]


@pytest.mark.parametrize("name", ["mlp_recompute_hidden", "dropout_recompute", "dropout_recompute_output"])
def test_recomputing_programs_match_keep_all_gradients(name: str) -> None:
    """Programs of a recomputing schedule give keep-all's output and gradients (dropout replays its mask)."""
    model_name, seq, _, _ = CASES[name]
    x = torch.randn(3, 4)
    results = []
    for schedule in (None, Schedule(seq)):
        model = make_model(model_name)

        def emit(joint: JointGraph, schedule=schedule):
            return emit_programs(joint, schedule or Schedule.keep_all(joint.to_problem({}, {})))

        step = build_step(model, (x,), {}, emit, torch.device("cpu"))
        torch.manual_seed(1)
        out = step((x,), {})
        out.square().sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a)
    assert all(g.abs().sum() > 0 for g in grads_a)
