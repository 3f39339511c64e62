"""Health and load polling of one backend: ``/health``, ``/metrics`` and ``/v1/models``.

* ``GET /health`` every ``health_interval_s``: ``unhealthy_after`` consecutive failures (non-200,
  connection error, timeout) take the backend's engines out of selection; one success brings them
  back. The proxy also reports a refused connection at once (:meth:`Fleet.report_unreachable`),
  so a dead backend stops receiving traffic before the next poll.
* ``GET /metrics`` every ``metrics_interval_s``: vLLM's ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` per engine (the ``engine``
  label is the data-parallel rank) correct the scheduler's own ledger (``set_metrics``);
  ``vllm:cache_config_info``'s ``num_gpu_blocks`` / ``num_cpu_blocks`` labels give each engine's
  capacity.
* ``GET /kvroute/handoff`` (with the token handoff on) until it answers, and again after the backend
  was unhealthy: the engine's token channel, if it runs :mod:`kvroute.vllm`.
* ``GET /v1/models`` until it answers: the served model names, which of them are LoRA adapters
  (an entry with a ``parent``), and ``max_model_len``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httpx

from kvroute.vllm.middleware import INFO_PATH

if TYPE_CHECKING:
    from kvroute.fleet import Backend, Fleet

log = logging.getLogger("kvroute.health")

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')
_WANTED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)


@dataclass(slots=True)
class EngineMetrics:
    """What one engine's ``/metrics`` says (None: not reported)."""

    running: int | None = None
    waiting: int = 0
    kv_usage: float = 0.0
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    labels: dict[str, str] = field(default_factory=dict)


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for line in text.splitlines():
        if not line.startswith(_WANTED):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        labels = {lm["key"]: lm["value"] for lm in _LABEL.finditer(m["labels"] or "")}
        yield m["name"], labels, value


def parse_vllm_metrics(text: str) -> dict[int, EngineMetrics]:
    """Per engine (DP rank, from the ``engine`` label; 0 without one), the load signals."""
    out: dict[int, EngineMetrics] = {}
    for name, labels, value in _samples(text):
        try:
            rank = int(labels.get("engine", "0"))
        except ValueError:
            rank = 0
        m = out.setdefault(rank, EngineMetrics())
        if name == "vllm:num_requests_running":
            m.running = int(value)
        elif name == "vllm:num_requests_waiting":
            m.waiting = int(value)
        elif name == "vllm:kv_cache_usage_perc":
            m.kv_usage = min(max(value, 0.0), 1.0)
        elif name == "vllm:cache_config_info":
            m.labels = labels
            for key in ("num_gpu_blocks", "num_cpu_blocks"):
                raw = labels.get(key, "")
                if raw.isdigit():
                    setattr(m, key, int(raw))
    return out


class HealthMonitor:
    """Polls one backend until :meth:`stop`."""

    def __init__(self, fleet: Fleet, backend: Backend, client: httpx.AsyncClient) -> None:
        self.fleet = fleet
        self.backend = backend
        self.client = client
        c = fleet.config
        self.interval_s = c.health_interval_s
        self.timeout_s = c.health_timeout_s
        self.unhealthy_after = c.unhealthy_after
        self.metrics_interval_s = c.metrics_interval_s
        self.failures = 0
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self.run(), name=f"kvroute-health-{self.backend.name}"
        )

    def poke(self) -> None:
        """Polls now instead of at the next interval (after a failure the proxy saw)."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_health = next_metrics = loop.time()
        while True:
            now = loop.time()
            if now >= next_health:
                await self.poll_health()
                next_health = now + self.interval_s
            if self.metrics_interval_s > 0 and now >= next_metrics and self.backend.healthy:
                await self.poll_metrics()
                next_metrics = now + self.metrics_interval_s
            if self.backend.healthy and self.backend.max_model_len is None and not self.backend.models:
                await self.poll_models()
            if self.fleet.handoff.active and self.backend.healthy and not self.backend.handoff_checked:
                await self.poll_handoff()
            wait = next_health - loop.time()
            if self.metrics_interval_s > 0:
                wait = min(wait, next_metrics - loop.time())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(wait, 0.01)):
                    await self._wake.wait()
                    next_health = loop.time()
            self._wake.clear()

    async def poll_health(self) -> bool:
        try:
            r = await self.client.get(self.backend.url + "/health", timeout=self.timeout_s)
            ok = r.status_code == 200
            error = None if ok else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, error = False, f"/health: {type(e).__name__}: {e}"
        if ok:
            self.failures = 0
            self.backend.last_error = None
            if not self.backend.healthy:
                log.info("backend %s is healthy again", self.backend.name)
                self.fleet.set_healthy(self.backend, True)
        else:
            self.failures += 1
            self.backend.last_error = error
            if self.backend.healthy and self.failures >= self.unhealthy_after:
                log.warning("backend %s is unhealthy: %s", self.backend.name, error)
                self.fleet.set_healthy(self.backend, False)
        return ok

    async def poll_metrics(self) -> None:
        try:
            r = await self.client.get(self.backend.url + "/metrics", timeout=self.timeout_s)
        except httpx.HTTPError:
            return
        if r.status_code != 200:
            return
        for rank, m in parse_vllm_metrics(r.text).items():
            self.fleet.update_engine_metrics(self.backend, rank, m)

    async def poll_handoff(self) -> None:
        """Where the backend's token channel is (``GET /kvroute/handoff`` of :mod:`kvroute.vllm`);
        any answer but a 200 with an endpoint means it has none."""
        try:
            r = await self.client.get(self.backend.url + INFO_PATH, timeout=self.timeout_s)
        except httpx.HTTPError:
            return  # ask again on the next round
        endpoint = None
        if r.status_code == 200:
            try:
                value = r.json().get("endpoint")
            except (ValueError, AttributeError):
                value = None
            endpoint = value if isinstance(value, str) and value else None
        self.backend.handoff_checked = True
        self.fleet.handoff.set_channel(self.backend, endpoint)

    async def poll_models(self) -> None:
        try:
            r = await self.client.get(self.backend.url + "/v1/models", timeout=self.timeout_s)
            data = r.json().get("data") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if not isinstance(data, list):
            return
        entries = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        self.backend.models = tuple(m["id"] for m in entries)
        # vLLM lists each LoRA adapter as a model whose parent is the base model; its KV blocks
        # are keyed by the adapter name, so requests for it are hashed with that name.
        self.backend.loras = tuple(m["id"] for m in entries if m.get("parent") not in (None, m["id"]))
        lens = [m.get("max_model_len") for m in entries]
        known = [x for x in lens if isinstance(x, int) and x > 0]
        if known:
            self.backend.max_model_len = min(known)
