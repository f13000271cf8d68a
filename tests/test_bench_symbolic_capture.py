"""The symbolic-capture benchmark times graphs a replay could use (reduced benchmark: one round, one layer)."""
from __future__ import annotations

import pytest

from remat_plugin.bench.symbolic_capture import run


def test_symbolic_capture_times_symbolic_graphs_that_run_at_another_shape():
    """Each of the four captures timed once; the exported program with batch and length as Dims runs at three
    quarters of the length with eager's loss, and the symbolic joint trace's inputs carry symbolic sizes."""
    result = run("gpt2-tiny", 1, n_layer=1, batch_size=2, seq_len=32)
    assert set(result["runs_s"]) == {"export, static", "export, symbolic", "joint trace, static",
                                     "joint trace, symbolic"}
    assert all(len(v) == 1 and v[0] > 0 for v in result["runs_s"].values())
    assert result["second_shape"]["seq_len"] == 24
    assert result["exported_loss_equal"]
    assert result["joint_symbolic_placeholders"] > 0


def test_symbolic_capture_refuses_a_model_without_a_sequence_length():
    """An image classifier has no length to make symbolic: the error names the models that do."""
    with pytest.raises(ValueError, match="no sequence length.*gpt2-tiny"):
        run("resnet-tiny", 1)
