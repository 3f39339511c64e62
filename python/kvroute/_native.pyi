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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Self, TypeAlias, TypedDict, final, type_check_only

from typing_extensions import Buffer

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "GENERATORS",
    "MAX_WORKERS",
    "POLICIES",
    "POLICY_PARAMS",
    "SIM_HASH_ALGOS",
    "SIM_PRESETS",
    "Decision",
    "InvalidArgumentError",
    "InvalidEventError",
    "KvrouteError",
    "NoEligibleWorkerError",
    "PrefixIndex",
    "SaturatedError",
    "Scheduler",
    "SimEngine",
    "StepResult",
    "TooManyWorkersError",
    "UnknownPolicyError",
    "UnknownWorkerError",
    "__version__",
    "block_hashes",
    "block_hashes_list",
    "chain_hash",
    "hit_bounds",
    "load_workload",
    "replay",
    "replay_mooncake",
    "root_hash",
    "vllm_block_hashes",
]

_Tokens: TypeAlias = Buffer | Sequence[int]
_Hashes: TypeAlias = Buffer | Sequence[int]

__version__: Final[str]
DEFAULT_BLOCK_SIZE: Final[int]
"""Tokens per block when none is given (vLLM's default)."""
MAX_WORKERS: Final[int]
"""Workers one index can track at once."""
POLICIES: Final[list[str]]
"""Names of the routing policies, ``"kvroute"`` (the default) first."""
POLICY_PARAMS: Final[list[str]]
"""Names of the policy knobs accepted by ``Scheduler(params=...)``."""
SIM_PRESETS: Final[list[str]]
"""Engine presets of :class:`SimEngine`, the default (``"llama3-8b-h100"``) first."""
GENERATORS: Final[list[str]]
"""Built-in workload generators of :func:`replay`: ``shared-prefix``, ``multi-turn``,
``tool-agent`` and ``doc-qa``."""
SIM_HASH_ALGOS: Final[list[str]]
"""Block-hash algorithms of :class:`SimEngine`: vLLM's ``sha256`` and ``sha256_cbor``, and
``xxh3`` (kvroute's content chain; fast, simulator only)."""

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

class SaturatedError(KvrouteError):
    """Every eligible worker is at its in-flight limit (answer 429 and retry later)."""

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

    def tier_entries(self, now_ns: int | None = None) -> list[tuple[int, tuple[int, int, int]]]:
        """Per registered worker, its resident blocks by tier: ``(gpu, cpu, speculative)`` (a block
        may be in both tiers; speculative = routed there, not confirmed, not expired)."""

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

def vllm_block_hashes(
    tokens: _Tokens,
    block_size: int = 16,
    algo: str = "sha256",
    seed: str | None = None,
    lora: tuple[str, str] | None = None,
    salt: str | None = None,
) -> list[int]:
    """vLLM's own chained block hashes (``sha256`` over pickle, or ``sha256_cbor``) as the u64 values
    its KV events carry. ``seed``: the engine's ``PYTHONHASHSEED`` if set (vLLM 0.33 otherwise seeds
    with ``"vllm-none-hash"``); ``lora``: ``(name, path)``; ``salt`` applies to block 0."""

def chain_hash(parent: int, tokens: _Tokens, extra: int = 0) -> int:
    """The hash of one block of ``tokens`` chained onto ``parent`` (``extra``: extra-keys digest)."""

@type_check_only
class LoadDict(TypedDict):
    prefill_tokens: int
    kv_blocks: int
    active: int
    decoding: int

@final
class Decision:
    """The outcome of one :meth:`Scheduler.select_and_reserve`: the worker, the reservation id to
    report the lifecycle against, the cached prefix there, and the score breakdown."""

    @property
    def worker(self) -> int: ...
    @property
    def reservation(self) -> int: ...
    @property
    def gpu_blocks(self) -> int: ...
    @property
    def cpu_blocks(self) -> int: ...
    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the worker is expected to compute."""
    @property
    def candidates(self) -> int:
        """Workers that were eligible."""
    @property
    def score(self) -> float:
        """The policy's own score for the chosen worker (units depend on the policy)."""
    @property
    def est_ttft_s(self) -> float:
        """kvroute's time-to-first-token estimate for the chosen worker, seconds."""
    @property
    def queued_prefill_tokens(self) -> int: ...
    @property
    def uncached_tokens(self) -> int: ...
    @property
    def cpu_tokens(self) -> int: ...
    @property
    def active(self) -> int: ...
    @property
    def decoding(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...

@final
class Scheduler:
    """Worker registry, in-flight ledger and routing policy over a shared :class:`PrefixIndex`.

    ``select_and_reserve`` is atomic: scoring, picking and booking happen under one lock. Report
    each reservation's lifecycle with :meth:`prefill_done`, :meth:`decode_progress` and, always
    (in a ``finally``), :meth:`release`. Times are monotonic nanoseconds (``None`` = now).
    """

    def __new__(
        cls,
        index: PrefixIndex,
        policy: str = "kvroute",
        *,
        block_size: int = 16,
        router_id: int = 0,
        reservation_ttl_s: float = 600.0,
        tombstone_ttl_s: float = 600.0,
        speculative_ttl_s: float = 5.0,
        approx_tree_entries: int = 4_000_000,
        max_inflight_per_worker: int = 0,
        seed: int = 0,
        params: Mapping[str, float] | None = None,
    ) -> Self:
        """``policy``: one of :data:`POLICIES`; ``params``: knob values by name, from
        :data:`POLICY_PARAMS`. Raises :class:`UnknownPolicyError` or
        :class:`InvalidArgumentError`."""

    @property
    def policy(self) -> str: ...
    @property
    def router_id(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    def params(self) -> dict[str, float]: ...
    def upsert_worker(
        self, worker: int, capacity_blocks: int = 0, cpu_capacity_blocks: int = 0, healthy: bool = True
    ) -> None: ...
    def remove_worker(self, worker: int, now_ns: int | None = None) -> int:
        """Drops the worker, its reservations and its index residency; raises :class:`UnknownWorkerError`."""
    def set_healthy(self, worker: int, healthy: bool) -> None: ...
    def set_metrics(
        self, worker: int, running: int | None = None, waiting: int = 0, kv_usage: float = 0.0
    ) -> None:
        """Engine-reported load from vLLM's ``/metrics``; ``running=None`` clears it."""
    def workers(self) -> list[tuple[int, int, int, bool]]: ...
    def select_and_reserve(
        self,
        tokens: _Tokens,
        *,
        expected_output_tokens: int = 0,
        lora: str | None = None,
        salt: str | None = None,
        exclude: Sequence[int] = ...,
        now_ns: int | None = None,
    ) -> Decision:
        """Hashes, matches, scores and books in one call. Raises :class:`NoEligibleWorkerError`
        (nobody healthy and not excluded) or :class:`SaturatedError` (all at their limit)."""
    def select_and_reserve_hashes(
        self,
        hashes: _Hashes,
        prompt_tokens: int,
        *,
        expected_output_tokens: int = 0,
        exclude: Sequence[int] = ...,
        now_ns: int | None = None,
    ) -> Decision: ...
    def pace(self, now_ns: int | None = None) -> float:
        """Seconds to wait before ``select_and_reserve``: 0.0 unless peer routers decide
        concurrently (a burst), when this router takes one decision per ``peer_window_s``."""
    def peer_concurrency(self) -> float:
        """Expected peer decisions concurrent with one of this router's (running estimate)."""
    def prefill_done(self, reservation: int, now_ns: int | None = None) -> bool: ...
    def decode_progress(self, reservation: int, generated: int, now_ns: int | None = None) -> bool: ...
    def release(self, reservation: int, now_ns: int | None = None) -> bool:
        """Idempotent: False if the reservation had already ended."""
    def apply_remote_reserve(
        self,
        origin: int,
        id: int,
        worker: int,
        prefill_tokens: int,
        prompt_blocks: int,
        hashes: _Hashes | None = None,
        now_ns: int | None = None,
    ) -> bool:
        """A peer router's reservation; idempotent, ignored if ``origin`` is this router or the
        key is tombstoned. Returns whether it changed anything."""
    def apply_remote_prefill_done(self, origin: int, id: int, now_ns: int | None = None) -> bool: ...
    def apply_remote_progress(
        self, origin: int, id: int, generated: int, now_ns: int | None = None
    ) -> bool: ...
    def apply_remote_finished(self, origin: int, id: int, now_ns: int | None = None) -> bool: ...
    def expire(self, now_ns: int | None = None) -> int: ...
    def loads(self) -> dict[int, LoadDict]: ...
    def reservations(self) -> int: ...
    def counters(self) -> dict[str, int]: ...
    def check_invariants(self) -> None: ...

_Output: TypeAlias = tuple[str, list[int], bool, str | None, int, int]

@final
class StepResult:
    """One engine step (frozen)."""

    @property
    def duration_s(self) -> float:
        """Modelled time the step takes, seconds (0 when nothing was computed)."""
    @property
    def events(self) -> bytes | None:
        """The step's KV-event batch as vLLM 0.33 publishes it (msgpack, map-encoded events), or
        ``None`` when the step changed no cache state."""
    @property
    def events_legacy(self) -> bytes | None:
        """The same batch with the legacy array encoding (vLLM <= 0.23)."""
    @property
    def seq(self) -> int | None:
        """The batch's sequence number (counts batches from 0; restarts on :meth:`SimEngine.reset`)."""
    @property
    def outputs(self) -> list[_Output]:
        """``(request_id, new_token_ids, finished, finish_reason, num_cached_tokens,
        prompt_tokens)`` per request that produced something; ``finish_reason`` is ``"length"``,
        ``"stop"`` or ``"abort"`` when finished."""

@final
class SimEngine:
    """A simulated vLLM v1 engine: continuous batching, chunked prefill, a prefix cache with
    vLLM's block hashes and events, an optional CPU tier, and a step-time model.

    Drive it with :meth:`step` while :meth:`has_work`; apply ``time_scale`` to ``duration_s`` in
    the caller. ``None`` arguments take the preset's value; bad values raise
    :class:`InvalidArgumentError`.
    """

    def __new__(
        cls,
        *,
        preset: str = "llama3-8b-h100",
        block_size: int | None = None,
        num_gpu_blocks: int | None = None,
        num_cpu_blocks: int = 0,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
        seed: int = 0,
        vocab_size: int = 128000,
        lora_paths: dict[str, str] | None = None,
    ) -> Self: ...
    def add_request(
        self,
        request_id: str,
        prompt_tokens: _Tokens,
        max_tokens: int,
        *,
        lora: str | None = None,
        salt: str | None = None,
        ignore_eos: bool = True,
        eos_token_id: int | None = None,
    ) -> None:
        """Queues a request. Raises :class:`InvalidArgumentError` for an id already in flight, an
        empty prompt, ``max_tokens < 1``, token ids outside the vocabulary, or a request that
        cannot fit in the KV cache."""
    def abort(self, request_id: str) -> bool:
        """Drops a request (its blocks stay cached); the next step reports it with reason
        ``"abort"``. False if the id is not in flight."""
    def has_work(self) -> bool: ...
    def step(self, now_s: float) -> StepResult:
        """One engine step at time ``now_s`` (the event batch's timestamp)."""
    def reset(self) -> None:
        """A restart: all requests dropped, caches empty, event ``seq`` and counters back to 0."""
    def metrics(self) -> dict[str, float]:
        """``running``, ``waiting``, ``kv_cache_usage`` (0..1), ``prefix_cache_queries``,
        ``prefix_cache_hits``, ``external_prefix_cache_queries``, ``external_prefix_cache_hits``
        (CPU tier), ``preemptions``, ``prompt_tokens_computed``, ``generation_tokens``,
        ``cpu_blocks_used``, ``num_gpu_blocks``, ``num_cpu_blocks``, ``block_size``, ``steps``."""
    def config(self) -> dict[str, object]:
        """The preset name and every resolved parameter (``latency``: the step-time coefficients)."""

def replay_mooncake(
    path: str,
    *,
    replicas: int = 8,
    policy: str = "round_robin",
    preset: str = "llama3-8b-h100",
    speedup: float = 1.0,
    num_gpu_blocks: int | None = None,
    num_cpu_blocks: int = 0,
    block_size: int | None = None,
    event_delay_s: float = 0.005,
    limit: int | None = None,
    seed: int = 0,
) -> dict[str, object]:
    """Replays a Mooncake JSONL trace on ``replicas`` simulated engines behind the router, on
    virtual time (the GIL is released). Returns the report: TTFT and end-to-end latency
    percentiles (ms), throughput, GPU/CPU token hit ratios, requests per replica, load
    imbalance, preemptions and ``wall_time_s``."""

def replay(
    source: str,
    *,
    requests: int | None = None,
    replicas: int = 8,
    policy: str = "round_robin",
    preset: str = "llama3-8b-h100",
    speedup: float = 1.0,
    rate: float | None = None,
    arrival: str = "trace",
    arrival_rate: float | None = None,
    arrival_trace: str | None = None,
    num_gpu_blocks: int | None = None,
    num_cpu_blocks: int = 0,
    block_size: int | None = None,
    event_delay_s: float = 0.005,
    routers: int = 1,
    fanout_delay_s: float | None = None,
    params: Sequence[tuple[str, float]] | None = None,
    seed: int = 0,
    progress: Callable[[int, int], object] | None = None,
) -> dict[str, Any]:
    """Replays a workload -- a generator name from :data:`GENERATORS` (``requests`` long, 2,000
    by default) or a Mooncake JSONL trace path (its first ``requests`` records) -- on
    ``replicas`` simulated engines behind ``routers`` router replicas, on virtual time, with the
    GIL released. Arrivals come from ``arrival`` (``"trace"``, ``"poisson"`` at
    ``arrival_rate``, ``"azure"`` gaps of the CSV ``arrival_trace``, or ``"burst"``: all at 0),
    then are divided by ``speedup``, or compressed to the mean ``rate``. With several routers
    and ``fanout_delay_s``, routers share reservations after that delay. ``params`` overrides
    policy knobs. ``progress(done, total)`` is called every 512 arrivals (with the GIL); if it
    raises, the replay stops and the exception propagates. Returns the report dict."""

def hit_bounds(
    source: str,
    *,
    requests: int | None = None,
    replicas: int = 8,
    preset: str = "llama3-8b-h100",
    num_gpu_blocks: int | None = None,
    block_size: int | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Offline token hit-ratio bounds of a workload on ``replicas`` engines: ``infinite`` (one
    cache that never evicts), ``pooled_lru`` (one LRU cache of the fleet's size: a perfectly
    cache-aware router) and ``belady`` (optimal replacement on that size), plus
    ``num_requests``, ``prompt_tokens`` and ``mean_rate``."""

def load_workload(
    source: str,
    *,
    requests: int | None = None,
    arrival: str = "trace",
    arrival_rate: float | None = None,
    arrival_trace: str | None = None,
    seed: int = 0,
) -> tuple[int, list[tuple[float, int, int, list[int]]]]:
    """A workload after its arrival process: ``(block_tokens, [(arrival_s, input_length,
    output_length, hash_ids), ...])``."""
