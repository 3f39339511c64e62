"""Several simulated replicas in the current event loop: the embeddable API.

::

    async with SimCluster(SimConfig(replicas=2, base_port=0, kv_events_port_base=0, replay_port_base=0)) as c:
        c.urls             # ["http://127.0.0.1:41234", ...]   (OpenAI base URL: url + "/v1")
        c.event_endpoints  # ["tcp://127.0.0.1:40001", ...]    ZMQ PUB, subscribe with SUB
        c.replay_endpoints # ["tcp://127.0.0.1:40002", ...]    ZMQ ROUTER, ask with DEALER

Each replica is a uvicorn server (httptools when installed) on its own pre-bound socket, an engine
step loop and a ZMQ publisher, all in this one loop; with ports 0 everything binds free loopback
ports. The ``kvroute sim`` command runs the same thing under uvloop until interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from types import TracebackType

import uvicorn
import zmq.asyncio

from kvroute.chat_template import ChatTemplate
from kvroute.sim.config import SimConfig
from kvroute.sim.replica import Replica
from kvroute.sim.server import build_app, quiet_crash_logs
from kvroute.tokenization import Tokenizer


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class SimCluster:
    """``config.replicas`` simulated vLLM replicas. Use as an async context manager."""

    def __init__(
        self,
        config: SimConfig,
        *,
        tokenizer: Tokenizer | None = None,
        template: ChatTemplate | None = None,
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._template = template
        self.replicas: list[Replica] = []
        self.urls: list[str] = []
        self._servers: list[uvicorn.Server] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ctx: zmq.asyncio.Context | None = None

    @property
    def event_endpoints(self) -> list[str | None]:
        """Each replica's PUB endpoint as subscribers reach it (None when events are off)."""
        return [r.publisher.endpoint if r.publisher else None for r in self.replicas]

    @property
    def replay_endpoints(self) -> list[str | None]:
        return [r.publisher.replay_endpoint if r.publisher else None for r in self.replicas]

    async def __aenter__(self) -> SimCluster:
        try:
            await self.start()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        c = self.config
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(Tokenizer, c.tokenizer)
        if self._template is None:
            self._template = ChatTemplate.from_file(c.chat_template) if c.chat_template else ChatTemplate()
        quiet_crash_logs()
        self._ctx = zmq.asyncio.Context()
        loop = asyncio.get_running_loop()
        for i in range(c.replicas):
            replica = Replica(i, c, tokenizer=self._tokenizer, template=self._template, zmq_ctx=self._ctx)
            self.replicas.append(replica)
            sock = _listen(c.host, c.http_port(i))
            host, port = sock.getsockname()[:2]
            self.urls.append(f"http://{f'[{host}]' if ':' in host else host}:{port}")
            server = uvicorn.Server(
                uvicorn.Config(
                    build_app(replica),
                    lifespan="off",
                    log_config=None,
                    log_level=c.log_level,
                    access_log=False,
                    timeout_graceful_shutdown=1,
                )
            )
            self._servers.append(server)
            # Server._serve is serve() without taking over SIGINT/SIGTERM: the embedding program
            # (or `kvroute sim`) owns the signals and the loop.
            self._tasks.append(loop.create_task(server._serve([sock]), name=f"kvroute-sim-http-{i}"))
            replica.start()
            if replica.handoff is not None:
                await replica.handoff.start()
        while not all(s.started for s in self._servers):
            for t in self._tasks:
                if t.done():
                    t.result()  # a server that failed to start raises here
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        for server in self._servers:
            server.should_exit = True
        for replica in self.replicas:
            replica.loop.crash()  # ends streams in flight, so shutdown does not wait on them
        for task in self._tasks:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
        for replica in self.replicas:
            await replica.aclose()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        self._tasks.clear()
        self._servers.clear()

    async def wait_closed(self) -> None:
        """Returns when every HTTP server has stopped."""
        await asyncio.gather(*self._tasks, return_exceptions=True)
