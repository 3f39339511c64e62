"""`_native.pyi` is the API: it must match the compiled module exactly."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mypy")


def test_stubtest_passes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "kvroute._native"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_version_is_the_crate_version() -> None:
    import kvroute

    assert kvroute.__version__ == kvroute._native.__version__
    assert kvroute.__version__.count(".") == 2
