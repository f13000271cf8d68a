"""Op times without running on the target device: FLOPs and bytes moved, for planning on ``meta``.

Planning a model too large for this machine (``remat plan --device meta``) cannot time its
ops, so each op is estimated from what it must do: ``max(FLOPs / compute rate, bytes /
memory bandwidth) + launch overhead`` (:mod:`remat_plugin.capture.op_work`).  The rates
describe a GPU-class device; only ratios between ops matter to the plan's choices, and the
predicted step time is an estimate, not a measurement.
"""
from __future__ import annotations

from remat_plugin.capture.joint import JointGraph
from remat_plugin.capture.measured_costs import OpCosts, op_signature
from remat_plugin.capture.op_work import GPU_CLASS, DeviceRates, work_ms
from remat_plugin.torch_private import unset_fake_temporarily


def estimate_costs(joint: JointGraph, rates: DeviceRates = GPU_CLASS, progress=None) -> OpCosts:
    """Estimated ``OpCosts`` of every op of ``joint`` (no real tensor is allocated)."""
    cache: dict[tuple, float] = {}
    time_ms: dict[str, float] = {}
    with unset_fake_temporarily():
        for i, node in enumerate(joint.ops):
            sig = op_signature(node)
            if sig not in cache:
                cache[sig] = work_ms(node, rates) + rates.launch_ms
            time_ms[node.name] = cache[sig]
            if progress is not None:
                progress(i + 1, len(joint.ops))
    return OpCosts(time_ms, {n.name: 0 for n in joint.ops})
