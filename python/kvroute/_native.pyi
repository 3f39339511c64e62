"""Rust core of kvroute (PyO3). Hand-written stub, checked against the module by ``mypy.stubtest``.

Token ids and block hashes cross the boundary without building Python objects per element:

* ``Tokens`` (uint32): ``array('I')``, a NumPy ``uint32`` array, any buffer of unsigned 4-byte
  items (explicit ``'<'``/``'>'`` byte orders are honoured), or ``bytes``/``bytearray``/
  ``memoryview`` read as little-endian u32 (length a multiple of 4).
* ``Hashes`` (uint64): ``array('Q')``, a NumPy ``uint64`` array, any buffer of unsigned 8-byte items,
  or bytes of little-endian u64 (length a multiple of 8) -- which is exactly what
  :func:`block_hashes` returns.
* Either also accepts a ``list``/``tuple`` of ints: the slow fallback.

A wrong dtype, a multi-dimensional buffer, a bad byte length or an out-of-range int raises
:class:`InvalidArgumentError` (a ``ValueError``); an object that is neither a buffer nor a sequence
of ints raises ``TypeError``.

Times are integer nanoseconds on a monotonic clock; ``now_ns=None`` reads ``time.monotonic_ns()``.
"""

from collections.abc import Sequence
from typing import Final, Self, TypeAlias, TypedDict, final, type_check_only

from typing_extensions import Buffer

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "MAX_WORKERS",
    "InvalidArgumentError",
    "InvalidEventError",
    "KvrouteError",
    "NoEligibleWorkerError",
    "PrefixIndex",
    "TooManyWorkersError",
    "UnknownPolicyError",
    "UnknownWorkerError",
    "__version__",
    "block_hashes",
    "block_hashes_list",
    "chain_hash",
    "root_hash",
]

_Tokens: TypeAlias = Buffer | Sequence[int]
_Hashes: TypeAlias = Buffer | Sequence[int]

__version__: Final[str]
DEFAULT_BLOCK_SIZE: Final[int]
"""Tokens per block when none is given (vLLM's default)."""
MAX_WORKERS: Final[int]
"""Workers one index can track at once."""

class KvrouteError(Exception):
    """Base class of every error raised by kvroute."""

class InvalidEventError(KvrouteError, ValueError):
    """A KV-event payload is malformed; it was rejected as a unit and changed nothing."""

class InvalidArgumentError(KvrouteError, ValueError):
    """An argument has the wrong value, dtype or length."""

class UnknownWorkerError(KvrouteError, KeyError):
    """The worker id is not registered."""

class NoEligibleWorkerError(KvrouteError):
    """No worker can take the request (all excluded, unhealthy or none registered)."""

class TooManyWorkersError(KvrouteError):
    """The worker limit of the index or scheduler is reached."""

class UnknownPolicyError(KvrouteError, ValueError):
    """The routing policy name is not known."""

@type_check_only
class IndexStats(TypedDict):
    """What :meth:`PrefixIndex.stats` returns. Counters are monotonic."""

    workers: int
    nodes: int
    blocks: int
    entries: int
    """Resident (block, worker) entries, any tier, speculative included."""
    memory_bytes: int
    """Heap bytes held by the index, measured from its containers' capacities."""
    bytes_per_entry: float
    """``memory_bytes / entries`` (0.0 when empty)."""
    payloads: int
    malformed_payloads: int
    events: int
    stored_blocks: int
    removed_blocks: int
    cleared: int
    unknown_events: int
    skipped_group_blocks: int
    skipped_medium_blocks: int
    orphan_blocks: int
    unknown_removals: int
    unplaced_blocks: int
    evicted_entries: int
    speculative_blocks: int

@final
class PrefixIndex:
    """Which worker holds which prefix of blocks, in GPU or CPU memory.

    Thread-safe: one lock inside; large inputs and waits for the lock release the GIL.
    Blocks are keyed by kvroute's content hashes (:func:`block_hashes`), not by engine hashes.
    """

    def __new__(cls, max_entries: int = 0, block_size: int = 16) -> Self:
        """``max_entries``: budget of resident (block, worker) entries, least recently matched
        evicted first; 0 = unbounded. ``block_size``: tokens per block for :meth:`match_tokens`."""

    @property
    def block_size(self) -> int: ...
    @property
    def max_entries(self) -> int: ...
    def add_worker(self, worker: int) -> None:
        """Registers a worker (idempotent). Raises :class:`TooManyWorkersError` past MAX_WORKERS."""

    def remove_worker(self, worker: int) -> int:
        """Unregisters a worker and drops all it holds; returns the entries dropped (0 if unknown)."""

    def clear_worker(self, worker: int) -> int:
        """Drops all a worker holds but keeps it registered; returns the entries dropped."""

    def workers(self) -> list[int]: ...
    def worker_entries(self, worker: int) -> int:
        """Resident blocks of one worker, any tier, speculative included (0 if unknown)."""

    def apply(self, worker: int, payload: Buffer, now_ns: int | None = None) -> None:
        """Applies one raw vLLM KV-event ZMQ payload frame (msgpack ``[ts, events, dp_rank]``) for
        ``worker``, registering it on first use. Raises :class:`InvalidEventError` on malformed
        input, which is counted in :meth:`stats` and changes nothing."""

    def find_matches(self, hashes: _Hashes, now_ns: int | None = None) -> dict[int, tuple[int, int]]:
        """Per worker, its cached prefix of ``hashes`` as ``(gpu_blocks, cpu_blocks)``: leading
        blocks on GPU (or speculatively routed there), then further blocks in the CPU tier.
        Workers with no cached block are omitted."""

    def match_tokens(
        self,
        tokens: _Tokens,
        lora: str | None = None,
        salt: str | None = None,
        now_ns: int | None = None,
    ) -> dict[int, tuple[int, int]]:
        """:func:`block_hashes` with this index's ``block_size``, then :meth:`find_matches`."""

    def speculate(self, worker: int, hashes: _Hashes, ttl_s: float, now_ns: int | None = None) -> None:
        """Counts ``hashes`` as on ``worker``'s GPU for ``ttl_s`` seconds (or until the engine's own
        events arrive): call it when routing a request there."""

    def expire(self, now_ns: int | None = None) -> None:
        """Frees speculative entries past their deadline (matching already ignores them)."""

    def stats(self) -> IndexStats: ...
    def check_invariants(self) -> None:
        """Verifies the tree's structure (O(size)); raises :class:`KvrouteError` if broken."""

def block_hashes(
    tokens: _Tokens, block_size: int = 16, lora: str | None = None, salt: str | None = None
) -> bytes:
    """Chained content hashes of the full blocks of ``tokens`` as little-endian u64 bytes (8 per
    block; a partial last block is not hashed). Pass the result straight to
    :meth:`PrefixIndex.find_matches` or :meth:`PrefixIndex.speculate`; view it with
    ``array('Q', h)`` or ``numpy.frombuffer(h, '<u8')``."""

def block_hashes_list(
    tokens: _Tokens, block_size: int = 16, lora: str | None = None, salt: str | None = None
) -> list[int]:
    """As :func:`block_hashes`, as a list of ints."""

def root_hash(lora: str | None = None, salt: str | None = None) -> int:
    """The parent hash of block 0 for this LoRA adapter name and cache salt."""

def chain_hash(parent: int, tokens: _Tokens, extra: int = 0) -> int:
    """The hash of one block of ``tokens`` chained onto ``parent`` (``extra``: extra-keys digest)."""
