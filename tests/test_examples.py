"""The examples run as the README shows them and print what it says they print."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_resnet_batchnorm_example_keeps_statistics_exact():
    """BatchNorm statistics and weights stay bitwise those of plain PyTorch; one update per step."""
    # batch 16 keeps it quick.  Its smallest feasible budget is 0.88 of the unmodified peak by the allocator: in
    # float64 a 3x3 convolution's im2col buffer (batch x 16*9 x 32*32 doubles) is scratch no plan can drop.
    out = _run("examples/resnet_batchnorm.py", "--steps", "2", "--batch-size", "16", "--budget", "0.9")
    assert out.count("equal to plain PyTorch: True") == 2 and "num_batches_tracked after 2 steps: 2" in out
    assert "remat plan" in out


@pytest.mark.slow
def test_plain_pytorch_demo_prints_plan_and_memory_saved():
    """`make demo`'s script: the plan table, each step within budget, the memory saved."""
    out = _run("examples/plain_pytorch.py", "--steps", "1")
    assert "remat plan" in out and "memory saved:" in out and "step 0: loss" in out


@pytest.mark.slow
def test_lightning_example_rejects_an_unknown_config_key():
    """The example's config is checked: a misspelt key is named, not ignored."""
    proc = subprocess.run([sys.executable, "examples/lightning_gpt2.py", "--config", "configs/gpt2_tiny.yaml",
                           "trainer.max_stepz=3"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and "max_stepz" in proc.stderr
