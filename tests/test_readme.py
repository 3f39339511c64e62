"""The README's Python examples are executed as written; the quick start against a real
``kvroute serve --sim 4`` (on a free port instead of 8000)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
QUICK_START_URL = "http://127.0.0.1:8000/v1"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_python_example_runs() -> None:
    blocks = [b for b in python_blocks() if QUICK_START_URL not in b]
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


@pytest.mark.timeout(120)
def test_readme_quick_start() -> None:
    text = README.read_text()
    assert "pip install .\nkvroute serve --sim 4\n" in text
    (client,) = [b for b in python_blocks() if QUICK_START_URL in b]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--sim", "4", "--port", str(port)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert f"OpenAI API at http://127.0.0.1:{port}/v1" in line, line
            code = client.replace(QUICK_START_URL, f"http://127.0.0.1:{port}/v1")
            exec(compile(code, str(README), "exec"), {})
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
