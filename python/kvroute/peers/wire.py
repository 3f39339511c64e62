"""The peer fan-out wire format: one ZMQ message per batch, little-endian, versioned.

Frame 0 is the batch::

    header   "KVRP" | version u8 | kind u8 | name length u16 | origin u64 | seq u64 | sent_at f64
    name     the sender's router name (UTF-8)
    records  back to back, each starting with its type byte

``kind`` is :data:`UPDATES` (reservations and their lifecycle, in the order they happened) or
:data:`SNAPSHOT` (every reservation the sender holds now: the receiver drops the sender's others).
``origin`` is the sender's router id (random per process), ``seq`` counts its batches, ``sent_at``
is its wall clock. With a shared secret, frame 1 is ``HMAC-SHA256(secret, frame 0)``.

Records (``engine``: the backend's name, UTF-8, and its data-parallel rank)::

    RESERVE   1 | id u64 | engine len u16 | rank u16 | prefill_tokens u32 | prompt_tokens u32
                | expected_output u32 | hashes u32 | engine | hashes x u64 (kvroute block hashes)
    PREFILL   2 | id u64
    PROGRESS  3 | id u64 | generated u32
    FINISHED  4 | id u64
    HELD      5 | id u64 | engine len u16 | rank u16 | prefill_tokens u32 | prompt_tokens u32
                | decoding u8 | generated u32 | engine          (snapshot entries)

Records are packed as they happen (:func:`reserve` ...) and joined into batches by the sender;
:func:`decode` checks every length and raises :class:`WireError` on anything malformed.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

MAGIC = b"KVRP"
VERSION = 1
UPDATES = 0
SNAPSHOT = 1
MAC_BYTES = 32

_HEADER = struct.Struct("<4sBBHQQd")
_RESERVE = struct.Struct("<BQHHIIII")
_ID = struct.Struct("<BQ")
_PROGRESS = struct.Struct("<BQI")
_HELD = struct.Struct("<BQHHIIBI")
T_RESERVE, T_PREFILL, T_PROGRESS, T_FINISHED, T_HELD = 1, 2, 3, 4, 5
U32 = 0xFFFF_FFFF


class WireError(ValueError):
    """A peer batch is malformed (it is dropped whole)."""


@dataclass(frozen=True, slots=True)
class Reserve:
    id: int
    backend: str
    rank: int
    prefill_tokens: int
    prompt_tokens: int
    expected_output: int
    hashes: bytes
    """kvroute block hashes as little-endian u64 bytes."""


@dataclass(frozen=True, slots=True)
class PrefillDone:
    id: int


@dataclass(frozen=True, slots=True)
class Progress:
    id: int
    generated: int


@dataclass(frozen=True, slots=True)
class Finished:
    id: int


@dataclass(frozen=True, slots=True)
class Held:
    """A reservation the sender holds, as a snapshot lists it (no hashes: speculation is short)."""

    id: int
    backend: str
    rank: int
    prefill_tokens: int
    prompt_tokens: int
    decoding: bool
    generated: int


Record = Reserve | PrefillDone | Progress | Finished | Held


@dataclass(frozen=True, slots=True)
class Batch:
    kind: int
    origin: int
    seq: int
    sent_at: float
    name: str
    records: list[Record]


def _u32(n: int) -> int:
    return min(max(n, 0), U32)


def reserve(
    id: int,
    backend: str,
    rank: int,
    prefill_tokens: int,
    prompt_tokens: int,
    expected_output: int,
    hashes: bytes,
) -> bytes:
    name = backend.encode()
    head = _RESERVE.pack(
        T_RESERVE,
        id,
        len(name),
        rank,
        _u32(prefill_tokens),
        _u32(prompt_tokens),
        _u32(expected_output),
        len(hashes) // 8,
    )
    return head + name + hashes[: len(hashes) // 8 * 8]


def prefill_done(id: int) -> bytes:
    return _ID.pack(T_PREFILL, id)


def progress(id: int, generated: int) -> bytes:
    return _PROGRESS.pack(T_PROGRESS, id, _u32(generated))


def finished(id: int) -> bytes:
    return _ID.pack(T_FINISHED, id)


def held(
    id: int, backend: str, rank: int, prefill_tokens: int, prompt_tokens: int, decoding: bool, generated: int
) -> bytes:
    name = backend.encode()
    head = _HELD.pack(
        T_HELD,
        id,
        len(name),
        rank,
        _u32(prefill_tokens),
        _u32(prompt_tokens),
        int(decoding),
        _u32(generated),
    )
    return head + name


def batch(kind: int, origin: int, seq: int, sent_at: float, name: str, records: list[bytes]) -> bytes:
    n = name.encode()[:1024]
    return _HEADER.pack(MAGIC, VERSION, kind, len(n), origin, seq, sent_at) + n + b"".join(records)


def sign(secret: bytes, frame: bytes) -> bytes:
    return hmac.new(secret, frame, hashlib.sha256).digest()


def verify(secret: bytes, frame: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(sign(secret, frame), tag)


def decode(frame: bytes) -> Batch:
    """One batch frame; raises :class:`WireError` if any part is malformed."""
    if len(frame) < _HEADER.size:
        raise WireError("short header")
    magic, version, kind, name_len, origin, seq, sent_at = _HEADER.unpack_from(frame)
    if magic != MAGIC or version != VERSION or kind not in (UPDATES, SNAPSHOT):
        raise WireError(f"bad header (magic {magic!r}, version {version}, kind {kind})")
    pos = _HEADER.size + name_len
    if pos > len(frame):
        raise WireError("short name")
    try:
        name = frame[_HEADER.size : pos].decode()
        records = _records(frame, pos)
    except (struct.error, UnicodeDecodeError) as e:
        raise WireError(str(e)) from None
    if kind == SNAPSHOT and not all(isinstance(r, Held) for r in records):
        raise WireError("a snapshot holds only HELD records")
    if kind == UPDATES and any(isinstance(r, Held) for r in records):
        raise WireError("HELD records belong to snapshots")
    return Batch(kind, origin, seq, sent_at, name, records)


def _take(frame: bytes, pos: int, n: int) -> bytes:
    if pos + n > len(frame):
        raise WireError("record runs past the end of the batch")
    return frame[pos : pos + n]


def _records(frame: bytes, pos: int) -> list[Record]:
    out: list[Record] = []
    end = len(frame)
    while pos < end:
        t = frame[pos]
        if t == T_RESERVE:
            _, id, name_len, rank, prefill, prompt, expected, n = _RESERVE.unpack_from(frame, pos)
            pos += _RESERVE.size
            name = _take(frame, pos, name_len).decode()
            pos += name_len
            hashes = _take(frame, pos, 8 * n)
            pos += 8 * n
            out.append(Reserve(id, name, rank, prefill, prompt, expected, hashes))
        elif t in (T_PREFILL, T_FINISHED):
            _, id = _ID.unpack_from(frame, pos)
            pos += _ID.size
            out.append(PrefillDone(id) if t == T_PREFILL else Finished(id))
        elif t == T_PROGRESS:
            _, id, generated = _PROGRESS.unpack_from(frame, pos)
            pos += _PROGRESS.size
            out.append(Progress(id, generated))
        elif t == T_HELD:
            _, id, name_len, rank, prefill, prompt, decoding, generated = _HELD.unpack_from(frame, pos)
            pos += _HELD.size
            name = _take(frame, pos, name_len).decode()
            pos += name_len
            out.append(Held(id, name, rank, prefill, prompt, bool(decoding), generated))
        else:
            raise WireError(f"unknown record type {t}")
    return out
