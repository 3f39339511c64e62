"""The `kvroute` command: only what exists (`--version`, `info`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvroute
from kvroute.cli import main


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvroute {kvroute.__version__}"


def test_info(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"kvroute {kvroute.__version__}" in out
    assert f"max_workers_per_index: {kvroute.MAX_WORKERS}" in out
    assert "default_block_size: 16 tokens" in out


def test_no_command_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kvroute" in capsys.readouterr().err


def test_unknown_command_is_rejected() -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve"])
    assert info.value.code == 2


def test_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"kvroute {kvroute.__version__}"
