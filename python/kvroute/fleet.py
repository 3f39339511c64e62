"""The fleet: backends, their engines (one per data-parallel rank) and the routing state.

A :class:`Fleet` owns the :class:`PrefixIndex` and the :class:`Scheduler`, assigns each engine a
worker id (never reused, so a late event or release for a removed engine cannot touch a new one),
and runs per backend a :class:`~kvroute.health.HealthMonitor` and per engine an
:class:`~kvroute.events.EventSubscriber`. Backends can be added and removed while serving. It also
holds the token-handoff channels (:class:`~kvroute.handoff.TokenHandoff`) and, with fan-out, the
:class:`~kvroute.peers.PeerFanout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import zmq.asyncio

from kvroute._native import PrefixIndex, Scheduler, UnknownWorkerError
from kvroute.config import BackendSpec, RouterConfig
from kvroute.events import EventStats, EventSubscriber
from kvroute.handoff import TokenHandoff
from kvroute.health import EngineMetrics, HealthMonitor

if TYPE_CHECKING:
    from kvroute.peers import PeerFanout

log = logging.getLogger("kvroute.fleet")


@dataclass(slots=True)
class Engine:
    """One engine (DP rank) of a backend: a worker of the scheduler."""

    worker: int
    rank: int
    events: EventStats = field(default_factory=EventStats)
    metrics: EngineMetrics | None = None
    capacity_blocks: int = 0
    cpu_capacity_blocks: int = 0


@dataclass(slots=True)
class Backend:
    spec: BackendSpec
    engines: list[Engine]
    healthy: bool = True
    last_error: str | None = None
    models: tuple[str, ...] = ()
    loras: tuple[str, ...] = ()
    max_model_len: int | None = None
    monitor: HealthMonitor | None = None
    subscribers: list[EventSubscriber] = field(default_factory=list)
    handoff_checked: bool = False
    """``GET /kvroute/handoff`` has answered since the backend was last healthy."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.url


class FleetError(ValueError):
    """A backend cannot be added or removed (duplicate or unknown name...)."""


class Fleet:
    """Create inside the running event loop; :meth:`aclose` when done."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        c = config
        self.index = PrefixIndex(max_entries=c.index_max_entries, block_size=c.block_size)
        self.scheduler = Scheduler(
            self.index,
            c.policy,
            block_size=c.block_size,
            # Random per process: a restarted router is a new origin to its peers, so its old
            # reservations (which its peers drop when it falls silent) never shadow new ones.
            router_id=secrets.randbits(63) | 1,
            reservation_ttl_s=c.reservation_ttl_s,
            speculative_ttl_s=c.speculative_ttl_s,
            max_inflight_per_worker=c.max_inflight_per_worker,
            seed=c.seed,
            params=dict(c.policy_params),
        )
        self.backends: dict[str, Backend] = {}
        self.by_worker: dict[int, tuple[Backend, Engine]] = {}
        self._next_worker = 0
        self._zmq = zmq.asyncio.Context()
        self.handoff = TokenHandoff(config)
        self.peers: PeerFanout | None = None
        """Peer fan-out, when configured (started by the server once it knows its name)."""
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=64), trust_env=False)
        self._lock = asyncio.Lock()

    async def add(self, spec: BackendSpec) -> Backend:
        """Registers a backend's engines with the scheduler and starts watching it."""
        async with self._lock:
            if spec.name in self.backends:
                raise FleetError(f"backend {spec.name!r} already exists")
            if any(b.url == spec.url for b in self.backends.values()):
                raise FleetError(f"a backend with url {spec.url} already exists")
            engines = []
            for rank in range(spec.dp):
                engines.append(Engine(worker=self._next_worker, rank=rank))
                self._next_worker += 1
            backend = Backend(spec=spec, engines=engines)
            for e in engines:
                self.scheduler.upsert_worker(e.worker)
                self.by_worker[e.worker] = (backend, e)
            self.backends[spec.name] = backend
            for e in engines:
                endpoint = spec.events_endpoint(e.rank)
                if endpoint is None:
                    continue
                sub = EventSubscriber(
                    self._zmq,
                    self.index,
                    e.worker,
                    endpoint,
                    spec.replay_endpoint(e.rank),
                    topic=self.config.events_topic,
                    replay_timeout_s=self.config.replay_timeout_s,
                    stats=e.events,
                )
                backend.subscribers.append(sub)
                sub.start()
            backend.monitor = HealthMonitor(self, backend, self._client)
            backend.monitor.start()
            log.info(
                "backend %s added: %s, %d engine(s), events %s, replay %s",
                spec.name,
                spec.url,
                spec.dp,
                spec.events or "off",
                spec.replay or "off",
            )
            return backend

    async def remove(self, name: str) -> int:
        """Stops watching a backend and drops its engines; returns reservations dropped.

        Requests still streaming from it finish; their releases are no-ops afterwards."""
        async with self._lock:
            backend = self.backends.pop(name, None)
            if backend is None:
                raise FleetError(f"no backend named {name!r}")
            await self._stop(backend)
            self.handoff.drop_channel(name)
            dropped = 0
            for e in backend.engines:
                self.by_worker.pop(e.worker, None)
                with contextlib.suppress(UnknownWorkerError):
                    dropped += self.scheduler.remove_worker(e.worker)
            log.info("backend %s removed (%d reservations dropped)", name, dropped)
            return dropped

    async def _stop(self, backend: Backend) -> None:
        if backend.monitor is not None:
            await backend.monitor.stop()
        for sub in backend.subscribers:
            await sub.stop()

    async def aclose(self) -> None:
        if self.peers is not None:
            await self.peers.aclose()
        for backend in list(self.backends.values()):
            await self._stop(backend)
        await self._client.aclose()
        self.handoff.close()
        self._zmq.term()

    def set_healthy(self, backend: Backend, healthy: bool) -> None:
        if healthy and not backend.healthy:
            for sub in backend.subscribers:
                sub.request_resync()
            backend.handoff_checked = False  # a restarted engine may have a new token channel
        backend.healthy = healthy
        for e in backend.engines:
            if e.worker in self.by_worker:
                self.scheduler.set_healthy(e.worker, healthy)

    def report_unreachable(self, worker: int, error: str) -> None:
        """The proxy could not connect: exclude the backend until a health poll succeeds."""
        entry = self.by_worker.get(worker)
        if entry is None:
            return
        backend = entry[0]
        backend.last_error = error
        if backend.healthy:
            log.warning("backend %s unreachable (%s): marked unhealthy", backend.name, error)
            self.set_healthy(backend, False)
        if backend.monitor is not None:
            backend.monitor.poke()

    def update_engine_metrics(self, backend: Backend, rank: int, m: EngineMetrics) -> None:
        if rank >= len(backend.engines) or backend.engines[rank].worker not in self.by_worker:
            return
        e = backend.engines[rank]
        e.metrics = m
        gpu = m.num_gpu_blocks or 0
        cpu = m.num_cpu_blocks or 0
        if (gpu, cpu) != (e.capacity_blocks, e.cpu_capacity_blocks):
            e.capacity_blocks, e.cpu_capacity_blocks = gpu, cpu
            # upsert replaces the worker's record, health and metrics included: restore them.
            self.scheduler.upsert_worker(
                e.worker, capacity_blocks=gpu, cpu_capacity_blocks=cpu, healthy=backend.healthy
            )
        self.scheduler.set_metrics(e.worker, running=m.running, waiting=m.waiting, kv_usage=m.kv_usage)

    def engine(self, worker: int) -> tuple[Backend, Engine] | None:
        return self.by_worker.get(worker)

    def max_model_len(self) -> int | None:
        """The configured context length, else the smallest any backend reports."""
        if self.config.max_model_len is not None:
            return self.config.max_model_len
        lens = [b.max_model_len for b in self.backends.values() if b.max_model_len]
        return min(lens) if lens else None

    def is_lora(self, model: str | None) -> bool:
        """Whether a backend serves ``model`` as a LoRA adapter (per its ``/v1/models``)."""
        return model is not None and any(model in b.loras for b in self.backends.values())

    def served_models(self) -> tuple[str, ...]:
        if self.config.served_model is not None:
            return (self.config.served_model,)
        seen: dict[str, None] = {}
        for b in self.backends.values():
            seen.update(dict.fromkeys(b.models))
        return tuple(seen)

    def snapshot(self) -> list[dict[str, Any]]:
        """Per backend: health, engines with ledger load, engine metrics, index share, events."""
        loads = self.scheduler.loads()
        out = []
        for b in self.backends.values():
            engines = []
            for e in b.engines:
                ev = e.events
                engines.append(
                    {
                        "worker": e.worker,
                        "rank": e.rank,
                        "load": loads.get(e.worker, {}),
                        "index_entries": self.index.worker_entries(e.worker),
                        "capacity_blocks": e.capacity_blocks,
                        "engine_metrics": None
                        if e.metrics is None
                        else {
                            "running": e.metrics.running,
                            "waiting": e.metrics.waiting,
                            "kv_usage": e.metrics.kv_usage,
                        },
                        "events": {
                            "connected": ev.connected,
                            "last_seq": ev.last_seq,
                            "batches": ev.batches,
                            "gaps": ev.gaps,
                            "replays": ev.replays,
                            "resyncs": ev.resyncs,
                            "lag_s": round(ev.lag_s, 6),
                        },
                    }
                )
            out.append(
                {
                    "name": b.name,
                    "url": b.url,
                    "healthy": b.healthy,
                    "last_error": b.last_error,
                    "events_endpoint": b.spec.events,
                    "replay_endpoint": b.spec.replay,
                    "token_handoff": self.handoff.endpoint(b.name),
                    "models": list(b.models),
                    "loras": list(b.loras),
                    "max_model_len": b.max_model_len,
                    "engines": engines,
                }
            )
        return out
