#!/usr/bin/env python3
"""kvroute's adapter for the peer index benchmark in `shared/bench/dynamo_index_bench.py`.

The harness measures NVIDIA Dynamo's Rust RadixTree (PyPI `ai-dynamo-runtime`) on a
prefix-sharing workload; this wrapper registers a `kvroute` adapter in it and runs it, so both
indexes see identical events and queries (the harness checks every query against its reference
model for each adapter). Child processes re-run this file, so they see the adapter too.

    python benches/dynamo_index_bench_kvroute.py --index kvroute --roundtrip none --pin-modes 0
    /path/to/venv-with-dynamo/bin/python $SHARED/bench/dynamo_index_bench.py --index dynamo --pin-modes 0

The harness's events carry, per block, an engine hash and a 64-bit "local" hash but no tokens.
kvroute indexes blocks by the content of their tokens, so the adapter spells each local hash as
two 32-bit tokens (block size 2): same prefix structure, same number of blocks per event and
query. Queries are converted to kvroute content hashes once per distinct query object (as the
harness precomputes Dynamo's local hashes), so the timed calls measure the lookup itself.
kvroute keeps no token ids, so it cannot dump its tree as events: run it with `--roundtrip none`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from array import array
from pathlib import Path
from typing import Any

import msgpack

import kvroute

HARNESS = Path(
    os.environ.get(
        "KVROUTE_DYNAMO_BENCH",
        Path(__file__).resolve().parents[2] / "shared" / "bench" / "dynamo_index_bench.py",
    )
)


def _local_tokens(local: Any) -> bytes:
    """Each 64-bit local hash as two little-endian u32 tokens."""
    return array("Q", local).tobytes()


class KvrouteAdapter:
    name = "kvroute"

    def __init__(self) -> None:
        self.idx = kvroute.PrefixIndex(block_size=2)
        self._memo: dict[int, tuple[object, bytes]] = {}

    @staticmethod
    def version() -> str:
        return "kvroute " + kvroute.__version__

    def new_empty(self) -> KvrouteAdapter:
        return KvrouteAdapter()

    @staticmethod
    def encode_stored(event_id: int, parent: int | None, blocks: list[tuple[int, int]]) -> bytes:
        tokens = array("I", _local_tokens([t for _, t in blocks])).tolist()
        ev = {
            "type": "BlockStored",
            "block_hashes": [b for b, _ in blocks],
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": 2,
            "medium": "GPU",
        }
        return msgpack.packb([0.0, [ev], 0])

    @staticmethod
    def encode_removed(event_id: int, hashes: list[int]) -> bytes:
        return msgpack.packb([0.0, [{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}], 0])

    def apply(self, worker: int, payload: bytes) -> None:
        self.idx.apply(worker, payload, 0)

    def _hashes(self, seq: Any) -> bytes:
        hit = self._memo.get(id(seq))
        if hit is not None and hit[0] is seq:
            return hit[1]
        h = kvroute.block_hashes(_local_tokens(seq), block_size=2)
        if isinstance(seq, list) and len(self._memo) < 4096:
            self._memo[id(seq)] = (seq, h)  # holding `seq` keeps its id from being reused
        return h

    def find(self, seq: Any, early_exit: bool = False) -> dict[int, tuple[int, int]]:
        return self.idx.find_matches(self._hashes(seq), 0)

    @staticmethod
    def scores(result: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
        return result

    @staticmethod
    def norm_scores(scores: dict[int, tuple[int, int]]) -> dict[int, int]:
        return {w: g + c for w, (g, c) in scores.items()}

    def remove_worker(self, w: int) -> None:
        self.idx.remove_worker(w)

    def clear_worker(self, w: int) -> None:
        self.idx.clear_worker(w)

    def hash_tokens(self, tokens: list[int], block_size: int) -> list[int]:
        # Any per-block ids work as the harness's local hashes; kvroute's own are chained.
        return kvroute.block_hashes_list(tokens, block_size)

    def dump(self) -> list[str]:
        return []

    @staticmethod
    def flatten_dump(dump: list[str]) -> tuple[set[Any], list[Any]]:
        return set(), []


def main() -> None:
    if not HARNESS.exists():
        sys.exit(f"harness not found at {HARNESS}; set KVROUTE_DYNAMO_BENCH")
    spec = importlib.util.spec_from_file_location("dynamo_index_bench", HARNESS)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ADAPTERS["kvroute"] = KvrouteAdapter
    mod.__file__ = os.path.abspath(__file__)  # children re-run this wrapper
    mod.main()


if __name__ == "__main__":
    main()
