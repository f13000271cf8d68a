"""Executor: turn a schedule into the forward and backward fx programs AOTAutograd runs.

The forward program computes every forward op once, in order, and returns the model
outputs plus the kept values.  The backward program follows ``Schedule.bwd_sequence``
op by op; fx code generation frees each value right after its last use, so the
program's memory follows the simulator's timeline (NOTE [schedule model]).  Both run
inside AOTAutograd's single ``autograd.Function``: parameters stay the caller's own
tensors, and gradient hooks (DDP) fire as usual.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from remat_plugin.capture.joint import RNG_SUFFIX, TANGENTS_OP, JointGraph, is_view_target
from remat_plugin.ir.problem import Schedule
from remat_plugin.torch_private import (
    FakeTensor,
    SavedForBackwardsAOTOutput,
    SavedForBackwardsNoVcCheckAOTOutput,
    extract_fwd_bwd_outputs,
    extract_graph_with_inputs_outputs,
    is_primal,
    is_tangent,
    lazy_graph_module,
)


def capture_rng_state(device: str) -> torch.Tensor:
    """The state of ``device``'s generator that a random op is about to consume (saved for its replay).

    ``device`` is the op's own ("cuda:1"), not the current device: a model spread over GPUs,
    or a CPU random op inside a CUDA model, replays from the generator it drew from.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_rng_state(dev)
    return torch.get_rng_state()


def replay_random(state: torch.Tensor, device: str, target, *args, **kwargs):
    """Run a random op again with the generator state of its first run, then restore the stream."""
    dev = torch.device(device)
    if dev.type == "cuda":
        current = torch.cuda.get_rng_state(dev)
        torch.cuda.set_rng_state(state, dev)
        try:
            return target(*args, **kwargs)
        finally:
            torch.cuda.set_rng_state(current, dev)
    current = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        return target(*args, **kwargs)
    finally:
        torch.set_rng_state(current)


def run_random(state: torch.Tensor, target, *args, **kwargs):
    """First run of a random op: ``state`` is only carried so the backward can replay it."""
    return target(*args, **kwargs)


def _insert_rng_captures(joint: JointGraph, names: set[str]) -> dict[str, fx.Node]:
    """Capture the generator state before each random op the schedule recomputes.

    The op is rewritten to take the capture as an argument, so the graph itself says
    the backward needs it (and the partitioner keeps it).
    """
    graph = joint.gm.graph
    made = {}
    for op_name in sorted(names):
        node = joint.node(op_name)
        with graph.inserting_before(node):
            device = joint.rng_device.get(op_name, joint.device_type)
            cap = graph.call_function(capture_rng_state, (device,))
        cap.meta["val"] = _fake_like_graph(joint, capture_rng_state(device))
        cap.meta["partitioner_tag"] = "is_forward"
        node.args = (cap, node.target, *node.args)  # type: ignore[arg-type]  # fx passes callables through
        node.target = run_random
        made[op_name + RNG_SUFFIX] = cap
    return made


def _fake_like_graph(joint: JointGraph, real: torch.Tensor) -> torch.Tensor:
    """``real`` as a fake tensor of the graph's fake mode: AOTAutograd reads saved values' metadata as fake tensors."""
    for node in joint.gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, FakeTensor):
            return val.fake_mode.from_tensor(real)
    return real


def _graph_ops(schedule: Schedule) -> list[str]:
    """The backward sequence without the planner's synthetic ops (tangents, rng captures): joint-graph nodes only."""
    return [n for n in schedule.bwd_sequence if n != TANGENTS_OP and not n.endswith(RNG_SUFFIX)]


def kept_values(joint: JointGraph, schedule: Schedule) -> list[str]:
    """Values (and placeholders) the backward program reads before recomputing them: what forward saves."""
    made: set[str] = set()
    kept: list[str] = []
    tangents = {t.name for t in joint.tangents}  # given to the backward, never saved
    for name in _graph_ops(schedule):
        node = joint.node(name)
        reads = list(joint.reads(node)) + _placeholder_reads(joint, node)
        if name in joint.random_ops:
            reads.append(name + RNG_SUFFIX)
        for v in reads:
            if v not in made and v not in kept and v not in tangents:
                kept.append(v)
        made.update(joint.values_of[name])
    return kept


def _placeholder_reads(joint: JointGraph, node: fx.Node) -> list[str]:
    """Placeholders a node reads, directly or through views."""
    found: list[str] = []

    def visit(a: fx.Node) -> None:
        if a.op == "placeholder":
            if a.name not in found:
                found.append(a.name)
        elif (
            a.op == "call_function"
            and (a.target is operator.getitem or is_view_target(a.target))
            and joint.root.get(a.name) is None
        ):
            fx.node.map_arg((a.args, a.kwargs), visit)

    fx.node.map_arg((node.args, node.kwargs), visit)
    return found


def emit_programs(joint: JointGraph, schedule: Schedule) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Forward and backward graph modules realising ``schedule`` on ``joint``."""
    kept = kept_values(joint, schedule)
    rng_needed = {k.removesuffix(RNG_SUFFIX) for k in kept if k.endswith(RNG_SUFFIX)}
    captures = _insert_rng_captures(joint, rng_needed)
    saved = [captures.get(k) or joint.node(k) for k in kept]
    for node in saved:
        if node.name in joint.buffer_primals:
            # NOTE: buffers (BatchNorm running stats) are updated in place right after the
            # forward, as in eager; backward ops that receive them (batch_norm_backward in
            # training mode) do not read their values, so the version check would only
            # reject a correct step.
            node.meta["saved_tensor_with_no_vc_check"] = True
    fw, bw_inputs, bw_descs = _extract_modules(joint, saved)
    return fw, _rebuild_backward(joint, schedule, bw_inputs, bw_descs, captures)


def _extract_modules(joint: JointGraph, saved: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node], list]:
    """Forward module (outputs + ``saved``), the backward program's inputs (``saved`` + tangents, in the
    order AOTAutograd passes them) and its outputs' descriptors.

    Like AOTAutograd's ``_extract_fwd_bwd_modules`` but without its pruning of saved values
    its own recompute-on-demand backward would not read: our schedule may read them.
    Saved tensors without a version check go last, as AOTAutograd's runtime expects.
    """
    saved = [n for n in saved if not n.meta.get("saved_tensor_with_no_vc_check")] + [
        n for n in saved if n.meta.get("saved_tensor_with_no_vc_check")
    ]
    first_no_vc = sum(not n.meta.get("saved_tensor_with_no_vc_check") for n in saved)
    fwd_outputs, _bwd_outputs, fwd_descs, bwd_descs = extract_fwd_bwd_outputs(
        joint.gm, num_fwd_outputs=joint.num_fwd_outputs
    )
    placeholders = joint.gm.graph.find_nodes(op="placeholder")
    primals = [p for p in placeholders if is_primal(p)]
    tangents = [p for p in placeholders if is_tangent(p)]
    saved_descs = [
        SavedForBackwardsNoVcCheckAOTOutput(i) if i >= first_no_vc else SavedForBackwardsAOTOutput(i)
        for i in range(len(saved))
    ]
    fwd_graph = extract_graph_with_inputs_outputs(
        joint.gm.graph, primals, fwd_outputs + saved, [*fwd_descs, *saved_descs], "forward"
    )
    # The backward program is built op by op by _rebuild_backward; extracting AOTAutograd's own backward
    # graph only to read its inputs cost 0.3 s per capture of a 16-layer Llama.
    return lazy_graph_module(joint.gm, fwd_graph), saved + tangents, list(bwd_descs)


def _rebuild_backward(
    joint: JointGraph, schedule: Schedule, inputs: list[fx.Node], output_descs: list, captures: dict[str, fx.Node]
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}  # joint value name -> its newest copy in the new graph
    capture_of = {cap.name: key for key, cap in captures.items()}
    for ph in inputs:
        new = graph.placeholder(ph.name)
        new.meta = dict(ph.meta)
        env[capture_of.get(ph.name, ph.name)] = new
    view_cache: dict[tuple[str, int], fx.Node] = {}

    def resolve(a: fx.Node) -> fx.Node:
        root = joint.root.get(a.name)
        if a.op == "placeholder" or root == a.name:
            if a.name not in env:
                raise AssertionError(f"schedule reads {a.name!r} before any copy of it exists")
            return env[a.name]
        # a view (or a getitem of a view op): re-derive it from the newest copy of its base
        key = (a.name, id(env.get(root)) if root is not None else -1)
        if key not in view_cache:
            view_cache[key] = graph.node_copy(a, resolve)
        return view_cache[key]

    for name in _graph_ops(schedule):
        node = joint.node(name)
        if name in joint.random_ops and joint.is_fwd[name]:
            _cap, target, *rest = node.args
            args, kwargs = fx.node.map_arg((tuple(rest), node.kwargs), resolve)
            device = joint.rng_device.get(name, joint.device_type)
            new = graph.call_function(replay_random, (env[name + RNG_SUFFIX], device, target, *args), kwargs)
            new.meta = dict(node.meta)
        else:
            new = graph.node_copy(node, resolve)
        if joint.values_of[name] == (name,):
            env[name] = new
        else:
            for user in node.users:
                if user.target is operator.getitem and user.name in joint.values_of[name]:
                    g = graph.call_function(operator.getitem, (new, user.args[1]))
                    g.meta = dict(user.meta)
                    env[user.name] = g
    joint_out = next(n for n in joint.gm.graph.nodes if n.op == "output")
    grads = list(joint_out.args[0])[joint.num_fwd_outputs:]
    outputs = tuple(resolve(g) if isinstance(g, fx.Node) else g for g in grads)
    graph.output(outputs).meta.update(
        desc=output_descs,
        output_stack_traces=[v.meta.get("stack_trace") if isinstance(v, fx.Node) else None for v in outputs],
    )
    gm = lazy_graph_module(joint.gm, graph)
    gm.graph.lint()
    return gm
