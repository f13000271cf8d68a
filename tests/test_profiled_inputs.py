"""Ops profiled alone get generated inputs on the device their kernels really use (measured_costs._input_device).

The fused attention kernels return their dropout's philox seed and offset as host tensors while the fake trace
places them on the GPU; made on the GPU, the backward kernel read a device pointer on the host and crashed the
process (seen on an H100 while planning gpt2-tiny in float32).  Without a GPU the same mismatch is made here
with a trace that says ``meta`` where the producer's kernel returns a CPU tensor.
"""
import operator

import torch
from torch import fx

from remat_plugin.capture import measured_costs
from remat_plugin.capture.measured_costs import _run_once

aten = torch.ops.aten


def _graph_whose_trace_misplaces_an_integer_output():
    """``max.dim`` on a CPU input (its indices really on the CPU), the trace claiming the indices are on meta;
    a consumer reads the indices and a float value traced on meta."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    y = g.placeholder("y")
    y.meta["val"] = torch.empty(4, device="meta")
    producer = g.call_function(aten.max.dim, (x, 1))
    indices = g.call_function(operator.getitem, (producer, 1))
    indices.meta["val"] = torch.empty(4, dtype=torch.long, device="meta")
    consumer = g.call_function(aten.add.Tensor, (y, indices))
    return consumer


def test_an_integer_output_is_made_where_its_producer_really_returns_it(monkeypatch):
    monkeypatch.setattr(measured_costs, "_output_devices", {})
    consumer = _graph_whose_trace_misplaces_an_integer_output()
    _, (y, indices), _ = _run_once(consumer, torch.device("meta"), {})
    assert indices.device.type == "cpu" and indices.dtype == torch.long  # the producer's kernel, not the trace
    assert y.device.type == "meta"  # floats go to the step's device as traced
    assert measured_costs._output_devices == {(str(aten.max.dim), 1, "meta"): torch.device("cpu")}


def test_on_a_cpu_step_nothing_is_run_ahead(monkeypatch):
    monkeypatch.setattr(measured_costs, "_output_devices", {})
    consumer = _graph_whose_trace_misplaces_an_integer_output()
    _, (y, indices), _ = _run_once(consumer, torch.device("cpu"), {})
    assert y.device.type == indices.device.type == "cpu" and measured_costs._output_devices == {}
