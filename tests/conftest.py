from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

SHARED = Path(__file__).parents[1] / ".." / "shared"
GOLDEN = SHARED / "golden" / "vllm-0.33.0-seed1.jsonl"


@pytest.fixture(scope="session")
def golden_stream() -> list[dict[str, Any]]:
    """The records (header, events, probes) of the vLLM golden stream, in file order."""
    if not GOLDEN.is_file():
        pytest.skip(f"golden stream not present at {GOLDEN.resolve()} (it lives in the shared/ checkout)")
    with GOLDEN.open() as f:
        return [json.loads(line) for line in f]
