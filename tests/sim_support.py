"""Helpers for the simulator's end-to-end tests: a cluster on a background event loop.

The cluster runs in its own thread so that the tests can use blocking clients (the sync ``openai``
client, plain ZMQ sockets) as well as their own event loop for the async client.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import httpx

from kvroute.sim import SimCluster, SimConfig
from kvroute.tokenization import Tokenizer

T = TypeVar("T")
START_TIMEOUT_S = 30.0

_tokenizer: Tokenizer | None = None


def shared_tokenizer() -> Tokenizer:
    global _tokenizer
    if _tokenizer is None:
        _tokenizer = Tokenizer()
    return _tokenizer


def sim_config(**changes: object) -> SimConfig:
    """A loopback-only config with free ports and a fast clock."""
    base: dict[str, object] = {
        "model": "sim-model",
        "base_port": 0,
        "kv_events_port_base": 0,
        "replay_port_base": 0,
        "time_scale": 20.0,
        "max_model_len": 4096,
        "log_level": "error",
    }
    base.update(changes)
    return SimConfig.from_env({}, **base)


class ClusterThread:
    """``with ClusterThread(config) as c:`` -- a started :class:`SimCluster` on its own loop."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sim-cluster", daemon=True)
        self.cluster = SimCluster(config, tokenizer=shared_tokenizer())

    def __enter__(self) -> ClusterThread:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self.cluster.start(), self.loop).result(START_TIMEOUT_S)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()

    def _stop(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.cluster.aclose(), self.loop).result(START_TIMEOUT_S)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(START_TIMEOUT_S)
            self.loop.close()

    def call(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the cluster's loop (replica state is only touched from there)."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(START_TIMEOUT_S)

    @property
    def urls(self) -> list[str]:
        return self.cluster.urls

    def fault(self, replica: int, kind: str, value: float | None = None) -> dict[str, object]:
        r = httpx.post(f"{self.urls[replica]}/admin/fault", json={"kind": kind, "value": value}, timeout=10)
        r.raise_for_status()
        state: dict[str, object] = r.json()
        return state


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` (with these label values) on a replica's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    found = False
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"{name} not in /metrics"
    return total
