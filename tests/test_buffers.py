"""Token ids and hashes cross as buffers: every accepted kind gives the same answer."""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute import InvalidArgumentError, PrefixIndex, block_hashes, block_hashes_list, chain_hash, root_hash

TOKENS = [(i * 7919) % 150_000 for i in range(100)]  # 6 full blocks of 16 and a partial one
EXPECTED = block_hashes_list(TOKENS)

TOKEN_KINDS: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "tuple": tuple,
    "array-I": lambda t: array("I", t),
    "numpy-uint32": lambda t: np.array(t, dtype=np.uint32),
    "numpy-uint32-strided": lambda t: np.repeat(np.array(t, dtype=np.uint32), 2)[::2],
    "numpy-big-endian": lambda t: np.array(t, dtype=">u4"),
    "numpy-unaligned": lambda t: np.frombuffer(b"\0" + np.array(t, "<u4").tobytes(), "<u4", offset=1),
    "ctypes-little-endian": lambda t: (ctypes.c_uint32.__ctype_le__ * len(t))(*t),
    "bytes-le": lambda t: np.array(t, dtype="<u4").tobytes(),
    "bytearray-le": lambda t: bytearray(np.array(t, dtype="<u4").tobytes()),
    "memoryview-le": lambda t: memoryview(np.array(t, dtype="<u4").tobytes()),
    "numpy-uint8": lambda t: np.frombuffer(np.array(t, dtype="<u4").tobytes(), np.uint8),
}


@pytest.mark.parametrize("kind", TOKEN_KINDS)
def test_token_kinds_hash_identically(kind: str) -> None:
    tokens = TOKEN_KINDS[kind](TOKENS)
    assert block_hashes_list(tokens) == EXPECTED
    assert block_hashes(tokens) == np.array(EXPECTED, dtype="<u8").tobytes()


def test_any_sequence_of_ints_is_accepted() -> None:
    assert block_hashes_list(range(64)) == block_hashes_list(list(range(64)))


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 20))
def test_buffer_and_list_agree(tokens: list[int], block_size: int) -> None:
    expected = block_hashes_list(tokens, block_size)
    assert len(expected) == len(tokens) // block_size
    assert block_hashes_list(array("I", tokens), block_size) == expected
    assert block_hashes_list(np.array(tokens, dtype=np.uint32), block_size) == expected
    assert block_hashes_list(np.array(tokens, dtype="<u4").tobytes(), block_size) == expected


def test_block_hashes_bytes_round_trip() -> None:
    raw = block_hashes(TOKENS)
    assert isinstance(raw, bytes)
    assert list(array("Q", raw)) == EXPECTED
    assert np.frombuffer(raw, "<u8").tolist() == EXPECTED


def test_chain_matches_block_hashes() -> None:
    h = root_hash(lora="sql-lora", salt="tenant-a")
    chained = []
    for i in range(0, 96, 16):
        h = chain_hash(h, array("I", TOKENS[i : i + 16]))
        chained.append(h)
    assert chained == block_hashes_list(TOKENS, lora="sql-lora", salt="tenant-a")
    assert chained != EXPECTED


def test_lora_and_salt_change_the_chain() -> None:
    variants = {
        tuple(block_hashes_list(TOKENS, lora=lora, salt=salt))
        for lora in (None, "a", "b")
        for salt in (None, "a", "b")
    }
    assert len(variants) == 9


def test_large_input_matches_small_path() -> None:
    # Over the GIL-release threshold; same answer as hashing block by block.
    tokens = np.arange(200_000, dtype=np.uint32)
    assert block_hashes_list(tokens)[:3] == block_hashes_list(tokens[:48])


HASH_KINDS: dict[str, Callable[[list[int]], Any]] = {
    "list": list,
    "array-Q": lambda h: array("Q", h),
    "numpy-uint64": lambda h: np.array(h, dtype=np.uint64),
    "numpy-big-endian": lambda h: np.array(h, dtype=">u8"),
    "bytes-le": lambda h: np.array(h, dtype="<u8").tobytes(),
    "memoryview-le": lambda h: memoryview(np.array(h, dtype="<u8").tobytes()),
}


@pytest.mark.parametrize("kind", HASH_KINDS)
def test_hash_kinds_match_identically(kind: str) -> None:
    index = PrefixIndex()
    index.speculate(1, EXPECTED, ttl_s=60.0, now_ns=0)
    assert index.find_matches(HASH_KINDS[kind](EXPECTED), now_ns=1) == {1: (6, 0)}


BAD_TOKENS: dict[str, Any] = {
    "int32": np.array(TOKENS, dtype=np.int32),
    "uint64": np.array(TOKENS, dtype=np.uint64),
    "float32": np.array(TOKENS, dtype=np.float32),
    "array-i": array("i", TOKENS),
    "array-Q": array("Q", TOKENS),
    "2-d": np.zeros((4, 16), dtype=np.uint32),
    "bytes-not-multiple-of-4": b"\0" * 65,
    "negative-int": [1, -1],
    "int-too-large": [2**32],
}


@pytest.mark.parametrize("kind", BAD_TOKENS)
def test_bad_token_buffers_raise_value_error(kind: str) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        block_hashes(BAD_TOKENS[kind])
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidArgumentError):
        PrefixIndex().match_tokens(BAD_TOKENS[kind])


BAD_HASHES: dict[str, Any] = {
    "uint32": np.array(TOKENS, dtype=np.uint32),
    "int64": np.array(TOKENS, dtype=np.int64),
    "bytes-not-multiple-of-8": b"\0" * 12,
    "negative-int": [-5],
    "int-too-large": [2**64],
}


@pytest.mark.parametrize("kind", BAD_HASHES)
def test_bad_hash_buffers_raise_value_error(kind: str) -> None:
    index = PrefixIndex()
    with pytest.raises(InvalidArgumentError):
        index.find_matches(BAD_HASHES[kind])
    with pytest.raises(InvalidArgumentError):
        index.speculate(0, BAD_HASHES[kind], ttl_s=1.0)
    assert index.workers() == []


@pytest.mark.parametrize("obj", ["0123", 17, 1.5, None, {1, 2}, ["a"]], ids=repr)
def test_non_buffers_raise_type_error(obj: object) -> None:
    with pytest.raises(TypeError):
        block_hashes(obj)  # type: ignore[arg-type]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(InvalidArgumentError):
        block_hashes(TOKENS, block_size=0)
    with pytest.raises(InvalidArgumentError):
        PrefixIndex(block_size=0)
