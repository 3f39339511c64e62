"""``--compare dynamo``: NVIDIA Dynamo's own trace replay on the same trace, in its own interpreter.

Dynamo's replay (``dynamo._core.run_mocker_trace_replay`` from the ``ai-dynamo-runtime`` wheel) runs
in a separate Python given by ``--dynamo-python`` (its wheel and kvroute's need not share an
environment). It replays the same Mooncake trace on the same number of workers with its mocker
engine, whose defaults and timing model the ``dynamo-mocker`` preset mirrors, at the same arrival
speedups, once with ``router_mode="round_robin"`` and once with its KV router.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

#: Where the project's development machines keep an environment with ``ai-dynamo-runtime``.
DEFAULT_DYNAMO_PYTHON = "/work/.venv-dynamo/bin/python"
MODES = ("round_robin", "kv_router")
#: Tokens per ``hash_ids`` entry of a Mooncake trace.
TRACE_BLOCK_TOKENS = 512


def default_python() -> str | None:
    """``$KVROUTE_DYNAMO_PYTHON``, else the default environment if it exists."""
    env = os.environ.get("KVROUTE_DYNAMO_PYTHON")
    if env:
        return env
    return DEFAULT_DYNAMO_PYTHON if Path(DEFAULT_DYNAMO_PYTHON).exists() else None


class DynamoError(RuntimeError):
    """Dynamo's replay could not be run or failed."""


def run(
    python: str,
    trace: str,
    *,
    workers: int,
    speedups: list[float],
    num_gpu_blocks: int | None = None,
    timeout_s: float = 1800.0,
) -> list[dict[str, Any]]:
    """One row per (speedup, router mode), with kvroute's report keys where they correspond."""
    args = {
        "trace": str(Path(trace).resolve()),
        "workers": workers,
        "speedups": speedups,
        "modes": list(MODES),
        "engine": {"num_gpu_blocks": num_gpu_blocks} if num_gpu_blocks else {},
        "block_size": TRACE_BLOCK_TOKENS,
    }
    # Run as ``-I -c SOURCE``: no script folder on sys.path, where ``dynamo.py`` (this module)
    # would shadow Dynamo's package, and no user site or environment paths.
    runner = Path(__file__).with_name("_dynamo_runner.py").read_text()
    try:
        out = subprocess.run(
            [python, "-I", "-c", runner, json.dumps(args)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DynamoError(f"cannot run Dynamo's replay with {python}: {e}") from e
    if out.returncode != 0:
        tail = out.stderr.strip().splitlines()[-5:]
        raise DynamoError(f"Dynamo's replay failed (exit {out.returncode}): " + " | ".join(tail))
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    for r in rows:
        r["policy"] = f"dynamo:{r['router_mode']}"
        if r.get("duration_ms") is not None:
            r["duration_s"] = r["duration_ms"] / 1000.0
    return rows
