"""Helpers of the router's end-to-end tests: a router (with its ``--sim`` engines) on a background
event loop, and a scriptable fake backend for what a simulator cannot show (the exact bytes a
backend receives, answers on demand).

Everything listens on 127.0.0.1 with free ports; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvroute.config import RouterConfig
from kvroute.server import RouterServer

T = TypeVar("T")
TIMEOUT_S = 30.0


def router_config(**changes: Any) -> RouterConfig:
    """A fast, loopback-only router config (sim engines 50x faster than real time)."""
    base: dict[str, Any] = {
        "port": 0,
        "sim_time_scale": 50.0,
        "log_level": "warning",
        "admin_key": "admin-key",
        "health_interval_s": 0.2,
        "health_timeout_s": 1.0,
        "metrics_interval_s": 0.2,
        "unhealthy_after": 1,
        "connect_timeout_s": 1.0,
        "first_byte_timeout_s": 10.0,
        "read_timeout_s": 10.0,
        "replay_timeout_s": 1.0,
    }
    base.update(changes)
    return RouterConfig(**base)


class RouterThread:
    """``with RouterThread(config) as r:`` -- a started :class:`RouterServer` on its own loop."""

    def __init__(self, config: RouterConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router", daemon=True)
        self.router = RouterServer(config)
        self.fakes: list[FakeBackend] = []

    def __enter__(self) -> RouterThread:
        self._thread.start()
        try:
            self.run(self.router.start())
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
            self.run(self.router.aclose())
            for fake in self.fakes:
                if not fake.closed:
                    self.run(fake.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(TIMEOUT_S)
            self.loop.close()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT_S)

    def call(self, fn: Callable[[], T]) -> T:
        """Runs ``fn`` on the router's loop."""

        async def run() -> T:
            return fn()

        result: T = self.run(run())
        return result

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def base_url(self) -> str:
        return self.router.url + "/v1"

    @property
    def sim_urls(self) -> list[str]:
        assert self.router.sim is not None
        return self.router.sim.urls

    def status(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/status", timeout=10)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def fault(self, replica: int, kind: str, value: float | None = None) -> None:
        r = httpx.post(
            f"{self.sim_urls[replica]}/admin/fault", json={"kind": kind, "value": value}, timeout=10
        )
        r.raise_for_status()

    def admin(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {"authorization": "Bearer admin-key"}
        return httpx.request(method, self.url + path, headers=headers, timeout=10, **kw)

    def ledger(self) -> tuple[int, int]:
        """(reservations, active requests over all engines) in the scheduler's ledger."""
        sched = self.router.state.fleet.scheduler

        def read() -> tuple[int, int]:
            return sched.reservations(), sum(v["active"] for v in sched.loads().values())

        return self.call(read)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Waits until the ledger is empty (every reservation released)."""
        wait_until(lambda: self.ledger() == (0, 0), timeout, lambda: f"ledger {self.ledger()}")

    def prompt_tokens(self, messages: list[dict[str, Any]]) -> bytes:
        """A chat prompt's token ids (u32 bytes), as the router computes them."""
        prompt = self.run(self.router.state.encoder.chat(messages))
        tokens: bytes = prompt.tokens
        return tokens

    def cached_blocks(self, backend: str, tokens: bytes) -> int:
        """Leading blocks of ``tokens`` the router's index holds on ``backend``'s GPU."""
        fleet = self.router.state.fleet

        def read() -> int:
            worker = fleet.backends[backend].engines[0].worker
            return fleet.index.match_tokens(tokens).get(worker, (0, 0))[0]

        return self.call(read)

    def add_fake(self, **behaviour: Any) -> FakeBackend:
        fake = FakeBackend(**behaviour)
        self.run(fake.start())
        self.fakes.append(fake)
        return fake


def wait_until(
    cond: Callable[[], bool], timeout: float = 10.0, what: Callable[[], str] | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting" + (f": {what()}" if what else ""))
        time.sleep(0.02)


def completion_body(model: str = "fake", text: str = "hello") -> dict[str, Any]:
    return {
        "id": "cmpl-fake",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 1,
            "total_tokens": 11,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


@dataclass
class FakeBackend:
    """A scriptable vLLM stand-in: ``status`` (answer code), ``delay_s`` (before answering),
    ``chunks`` (SSE events streamed, ``chunk_delay_s`` apart), ``die_after`` (cut the stream after
    this many events).
    Records each inference request's headers and raw body."""

    status: int = 200
    delay_s: float = 0.0
    chunks: int = 3
    die_after: int | None = None
    chunk_delay_s: float = 0.01
    healthy: bool = True
    model: str = "kvroute-sim"
    loras: tuple[str, ...] = ()
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    url: str = ""
    closed: bool = False

    async def start(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        sock.setblocking(False)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._inference, methods=["POST"]),
                Route("/v1/completions", self._inference, methods=["POST"]),
                Route("/health", self._health),
                Route("/v1/models", self._models),
            ]
        )
        self._server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False))
        self._task = asyncio.get_running_loop().create_task(self._server._serve([sock]))
        while not self._server.started:
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        self.closed = True
        self._server.should_exit = True
        self._server.force_exit = True
        await self._task

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _models(self, request: Request) -> Response:
        data = [{"id": self.model, "max_model_len": 4096, "parent": None}]
        data += [{"id": name, "max_model_len": 4096, "parent": self.model} for name in self.loras]
        return JSONResponse({"object": "list", "data": data})

    async def _inference(self, request: Request) -> Response:
        body = await request.body()
        self.received.append((dict(request.headers), body))
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return JSONResponse({"error": {"message": "fake failure", "code": self.status}}, self.status)
        if not json.loads(body).get("stream"):
            return JSONResponse(completion_body(self.model))

        async def events() -> AsyncIterator[bytes]:
            for i in range(self.chunks):
                if self.die_after is not None and i >= self.die_after:
                    raise ConnectionError("fake backend dies mid-stream")
                delta = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
                yield b"data: " + json.dumps(delta).encode() + b"\n\n"
                await asyncio.sleep(self.chunk_delay_s)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
