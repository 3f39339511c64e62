"""The `kvroute` command: `--version`, `info`, and how `serve` handles its flags."""

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
        main(["frobnicate"])
    assert info.value.code == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve"], "no backends: give --backends"),
        (["serve", "--sim", "2", "--port", "http"], "--port: expected an integer"),
        (["serve", "--backends", "ftp://x"], "url must be http"),
        (["serve", "--sim", "1", "--policy", "fastest"], "policy: unknown 'fastest'"),
        (["serve", "--sim", "1", "--policy-param", "x=1"], "unknown knob 'x'"),
    ],
)
def test_serve_rejects_bad_settings(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute serve: ")
    assert message in err


def test_serve_env_and_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVROUTE_SIM", "0")
    monkeypatch.setenv("KVROUTE_BACKENDS", "http://h:8000;events=nope")
    assert main(["serve"]) == 2
    assert "bad events 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "--backends" in out
    assert "KVROUTE_" in out


def test_module_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"kvroute {kvroute.__version__}"
