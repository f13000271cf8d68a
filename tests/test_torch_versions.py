"""The tested torch range is enforced: another release is refused at import with the fix, unless overridden."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from remat_plugin.torch_private import TESTED_TORCH, UnsupportedTorchError, _check_version


def test_the_installed_torch_is_a_tested_one():
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert (major, minor) in TESTED_TORCH


@pytest.mark.parametrize("version", ["2.13.0", "2.13.1+cpu", "2.14.1+cu130"])
def test_tested_releases_pass(version):
    _check_version(version)


@pytest.mark.parametrize("version", ["2.5.1", "2.12.0+cpu", "2.15.0", "3.0.0a0"])
def test_other_releases_are_refused_with_the_fix(version, monkeypatch):
    monkeypatch.delenv("REMAT_ALLOW_UNTESTED_TORCH", raising=False)
    with pytest.raises(UnsupportedTorchError, match=rf"torch {re.escape(version)} is not a tested release.*pip install 'torch>=2"):
        _check_version(version)
    monkeypatch.setenv("REMAT_ALLOW_UNTESTED_TORCH", "1")
    with pytest.warns(UserWarning, match="not a tested release"):
        _check_version(version)


def test_import_under_an_untested_torch_fails_at_import():
    """Seen from a fresh interpreter whose torch claims another release."""
    code = "import torch; torch.__version__ = '2.99.0'; import remat_plugin"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "UnsupportedTorchError" in proc.stderr and "2.99.0" in proc.stderr
