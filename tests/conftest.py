from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

SHARED = Path(__file__).parents[1] / ".." / "shared"
GOLDEN = SHARED / "golden" / "vllm-0.33.0-seed1.jsonl"


def golden_records() -> Iterator[dict[str, Any]]:
    with GOLDEN.open() as f:
        for line in f:
            yield json.loads(line)


@pytest.fixture
def golden_events() -> Iterator[dict[str, Any]]:
    """The `events` records of the vLLM golden stream, in file order."""
    if not GOLDEN.is_file():
        pytest.skip(f"golden stream not present at {GOLDEN.resolve()} (it lives in the shared/ checkout)")
    return (r for r in golden_records() if r["kind"] == "events")
