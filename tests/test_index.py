"""PrefixIndex binding contract: events in, matches out, counters and lifecycle."""

from __future__ import annotations

import ast
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from kvroute import InvalidEventError, PrefixIndex, block_hashes

TOKENS = list(range(1000, 1000 + 16 * 8))  # 8 full blocks
HASHES = block_hashes(TOKENS)
STUB = Path(__file__).parents[1] / "python" / "kvroute" / "_native.pyi"


def stored_payload(tokens: list[int], engine_hashes: list[int], parent: int | None = None) -> bytes:
    """One vLLM (>= 0.24) batch with a single GPU BlockStored event, as the engine encodes it."""
    event = {
        "type": "BlockStored",
        "block_hashes": engine_hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(engine_hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    return msgpack.packb([1760000000.0, [event], 0])


def stub_stats_keys() -> list[str]:
    tree = ast.parse(STUB.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "IndexStats")
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


# --- events -------------------------------------------------------------------------------------


def test_apply_golden_payload(golden_stream: list[dict[str, Any]]) -> None:
    record = next(r for r in golden_stream if r["kind"] == "events")
    payload = bytes.fromhex(record["payload_hex"])
    index = PrefixIndex()
    index.apply(record["worker"], payload, now_ns=0)
    index.check_invariants()
    stats = index.stats()
    assert stats["payloads"] == 1
    assert stats["malformed_payloads"] == 0
    assert stats["stored_blocks"] == record["n_stored"]
    # The stored prefix is found again from its tokens (first event: root-parented, no LoRA/salt).
    event = msgpack.unpackb(payload)[1][0]
    assert event["parent_block_hash"] is None
    assert event["lora_name"] is None
    expected = len(event["block_hashes"])
    assert index.match_tokens(event["token_ids"], now_ns=0) == {record["worker"]: (expected, 0)}


def test_golden_stream_probes(golden_stream: list[dict[str, Any]]) -> None:
    # Every probe of the stream: the index reports what vLLM's own prefix cache held.
    index = PrefixIndex()
    probes = 0
    for r in golden_stream:
        if r["kind"] == "events":
            index.apply(r["worker"], bytes.fromhex(r["payload_hex"]), now_ns=0)
        elif r["kind"] == "probe":
            found = index.match_tokens(r["tokens"], lora=r["lora"], salt=r["salt"], now_ns=0)
            got = {str(w): sum(found.get(w, (0, 0))) for w in range(3)}
            assert got == r["cached_blocks"], r["probe_id"]
            probes += 1
    assert probes > 100
    index.check_invariants()


def test_apply_built_payload_then_match() -> None:
    index = PrefixIndex()
    index.apply(3, stored_payload(TOKENS, list(range(1, 9))), now_ns=0)
    assert index.find_matches(HASHES, now_ns=0) == {3: (8, 0)}
    assert index.match_tokens(np.array(TOKENS[:40], np.uint32), now_ns=0) == {3: (2, 0)}
    assert index.worker_entries(3) == 8


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # a marker msgpack never uses
        b"\x93\xcb",  # truncated
        msgpack.packb({"not": "a batch"}),
        msgpack.packb([1.0, "events should be a list", 0]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": "x"}], 0]),
        stored_payload(TOKENS, list(range(1, 9))) + b"\x00",  # trailing garbage
        b"\xc1" * (64 << 10),  # large: decoded with the GIL released
    ],
    ids=["empty", "bad-marker", "truncated", "map", "events-not-list", "bad-event", "trailing", "large"],
)
def test_malformed_payload_raises_and_changes_nothing(payload: bytes) -> None:
    index = PrefixIndex()
    with pytest.raises(InvalidEventError):
        index.apply(5, payload, now_ns=0)
    stats = index.stats()
    assert (stats["payloads"], stats["malformed_payloads"]) == (1, 1)
    assert stats["entries"] == 0
    assert index.workers() == []


def test_payload_may_be_any_byte_buffer() -> None:
    index = PrefixIndex()
    for payload in (bytearray(b"\xc1"), memoryview(b"\xc1"), np.frombuffer(b"\xc1", np.uint8)):
        with pytest.raises(InvalidEventError):
            index.apply(0, payload)
    assert index.stats()["malformed_payloads"] == 3
    with pytest.raises(TypeError):
        index.apply(0, "not bytes")  # type: ignore[arg-type]


# --- speculation, matching, expiry --------------------------------------------------------------


def test_find_matches_after_speculate() -> None:
    index = PrefixIndex()
    assert index.find_matches(HASHES, now_ns=0) == {}
    index.speculate(1, HASHES, ttl_s=2.0, now_ns=0)
    index.speculate(2, block_hashes(TOKENS[:48]), ttl_s=2.0, now_ns=0)
    assert index.find_matches(HASHES, now_ns=1) == {1: (8, 0), 2: (3, 0)}
    assert index.match_tokens(TOKENS[:80], now_ns=1) == {1: (5, 0), 2: (3, 0)}
    assert index.match_tokens(TOKENS, salt="other", now_ns=1) == {}
    assert sorted(index.workers()) == [1, 2]
    assert index.stats()["speculative_blocks"] == 11
    index.check_invariants()


def test_speculation_expires() -> None:
    index = PrefixIndex()
    index.speculate(1, HASHES, ttl_s=1.0, now_ns=0)
    assert index.find_matches(HASHES, now_ns=999_999_999) == {1: (8, 0)}
    assert index.find_matches(HASHES, now_ns=1_000_000_000) == {}
    assert index.worker_entries(1) == 8
    index.expire(now_ns=1_000_000_000)
    assert index.worker_entries(1) == 0
    index.check_invariants()


def test_default_clock_is_monotonic_ns() -> None:
    index = PrefixIndex()
    index.speculate(1, HASHES, ttl_s=3600.0)
    assert index.find_matches(HASHES) == {1: (8, 0)}
    assert index.find_matches(HASHES, now_ns=time.monotonic_ns()) == {1: (8, 0)}
    assert index.find_matches(HASHES, now_ns=time.monotonic_ns() + 3601 * 10**9) == {}


@pytest.mark.parametrize("ttl_s", [-1.0, float("nan"), float("inf")])
def test_bad_ttl(ttl_s: float) -> None:
    with pytest.raises(ValueError, match="ttl_s must be finite"):
        PrefixIndex().speculate(1, HASHES, ttl_s=ttl_s)


def test_max_entries_bounds_memory() -> None:
    index = PrefixIndex(max_entries=100)
    assert (index.max_entries, index.block_size) == (100, 16)
    for i in range(50):
        index.speculate(i % 4, block_hashes(list(range(i * 1000, i * 1000 + 64))), ttl_s=60.0, now_ns=0)
    stats = index.stats()
    assert stats["entries"] <= 100
    assert stats["evicted_entries"] > 0
    index.check_invariants()


# --- workers ------------------------------------------------------------------------------------


def test_worker_removal() -> None:
    index = PrefixIndex()
    index.add_worker(9)
    index.speculate(1, HASHES, ttl_s=60.0, now_ns=0)
    index.speculate(2, HASHES, ttl_s=60.0, now_ns=0)
    assert sorted(index.workers()) == [1, 2, 9]
    assert index.remove_worker(1) == 8
    assert index.remove_worker(1) == 0
    assert sorted(index.workers()) == [2, 9]
    assert index.find_matches(HASHES, now_ns=1) == {2: (8, 0)}
    assert index.clear_worker(2) == 8
    assert sorted(index.workers()) == [2, 9]
    assert index.find_matches(HASHES, now_ns=1) == {}
    assert index.stats()["entries"] == 0
    index.check_invariants()


def test_worker_ids_are_u64() -> None:
    index = PrefixIndex()
    index.add_worker(2**64 - 1)
    assert index.workers() == [2**64 - 1]
    with pytest.raises(OverflowError):
        index.add_worker(-1)


# --- stats --------------------------------------------------------------------------------------


def test_stats_keys_match_the_stub() -> None:
    index = PrefixIndex()
    stats = index.stats()
    assert list(stats) == stub_stats_keys()
    assert all(type(v) is int for k, v in stats.items() if k != "bytes_per_entry")
    assert stats["bytes_per_entry"] == 0.0
    index.speculate(1, HASHES, ttl_s=60.0, now_ns=0)
    stats = index.stats()
    assert stats["entries"] == 8
    assert stats["memory_bytes"] > 0
    assert stats["bytes_per_entry"] == stats["memory_bytes"] / 8
    assert repr(index) == "PrefixIndex(max_entries=0, block_size=16, workers=1, entries=8)"


# --- threads ------------------------------------------------------------------------------------


def test_concurrent_use_from_threads() -> None:
    index = PrefixIndex()
    chains = [block_hashes(list(range(t * 10_000, t * 10_000 + 16 * 32))) for t in range(8)]

    def work(t: int) -> None:
        for i in range(200):
            index.speculate(t, chains[t], ttl_s=60.0, now_ns=i)
            assert index.find_matches(chains[t], now_ns=i)[t] == (32, 0)
            if i % 50 == 0:
                index.clear_worker(t)

    with ThreadPoolExecutor(max_workers=8) as pool:
        for done in [pool.submit(work, t) for t in range(8)]:
            done.result()  # re-raises a worker thread's failure
    index.check_invariants()
    assert sorted(index.workers()) == list(range(8))


def test_tier_entries_split_gpu_cpu_and_speculative() -> None:
    index = PrefixIndex()
    tokens = list(range(64))
    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12, 13, 14],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 16,
        "medium": "GPU",
    }
    index.apply(1, msgpack.packb([0.0, [stored], 0]), now_ns=0)
    placeholder = {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "token_ids": [],
        "block_size": 0,
        "medium": "CPU",
    }
    index.apply(1, msgpack.packb([0.0, [placeholder], 0]), now_ns=0)
    index.speculate(2, block_hashes(tokens[:48]), ttl_s=1.0, now_ns=0)
    assert dict(index.tier_entries(now_ns=0)) == {1: (4, 2, 0), 2: (0, 0, 3)}
    assert dict(index.tier_entries(now_ns=2_000_000_000)) == {1: (4, 2, 0), 2: (0, 0, 0)}
    assert index.find_matches(block_hashes(tokens), now_ns=0) == {1: (4, 0), 2: (3, 0)}
