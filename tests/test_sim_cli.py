"""``kvroute sim`` as a command: starts, serves, stops on SIGINT; bad flags exit 2."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from kvroute.cli import main


def test_bad_flags_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--replicas", "0"]) == 2
    assert "replicas" in capsys.readouterr().err
    assert main(["sim", "--fault", "explode"]) == 2
    assert "unknown fault kind" in capsys.readouterr().err


def test_engine_refusals_and_taken_ports_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert (
            main(["sim", "--base-port", str(port), "--kv-events-port-base", "0", "--replay-port-base", "0"])
            == 2
        )
    assert "kvroute sim:" in capsys.readouterr().err


def test_help_documents_ports_and_faults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    out = capsys.readouterr().out
    assert "5557+i" in out
    assert "KIND[=VALUE][@AT_SECONDS][/REPLICA]" in out


def test_command_serves_two_replicas_and_stops_on_sigint() -> None:
    cmd = [
        sys.executable, "-m", "kvroute.cli", "sim", "--replicas", "2", "--base-port", "0",
        "--kv-events-port-base", "0", "--replay-port-base", "0", "--model", "cli-model", "--time-scale", "50",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        urls = [re.search(r"(http://\S+)/v1", line) for line in lines]
        assert all(urls), lines
        for m in urls:
            assert m is not None
            models = httpx.get(f"{m.group(1)}/v1/models", timeout=10).json()
            assert models["data"][0]["id"] == "cli-model"
        assert "kv-events tcp://127.0.0.1:" in lines[0]
        r = httpx.post(
            f"{urls[1].group(1)}/v1/completions",  # type: ignore[union-attr]
            json={"prompt": "hello", "max_tokens": 3},
            timeout=10,
        )
        assert r.json()["usage"]["completion_tokens"] == 3
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        assert time.monotonic() - t0 < 20
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
