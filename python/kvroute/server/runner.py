"""Running the router: :class:`RouterServer` (embeddable) and :func:`serve` (the command).

::

    async with RouterServer(RouterConfig(sim=2, port=0)) as router:
        router.url          # "http://127.0.0.1:41234"  (OpenAI base URL: url + "/v1")
        router.state.fleet  # backends, scheduler, index

With ``config.sim = N`` it first starts N simulated vLLM engines in this process
(:class:`kvroute.sim.SimCluster`, free loopback ports, the router's own tokenizer and chat
template) and routes to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

import uvicorn

from kvroute.config import BackendSpec, RouterConfig
from kvroute.fleet import Fleet
from kvroute.prompts import PromptEncoder, load_tokenizer_files
from kvroute.proxy import Proxy
from kvroute.server.app import RouterState, build_app
from kvroute.server.limits import Limiter
from kvroute.server.metrics import Metrics

if TYPE_CHECKING:
    from kvroute.sim import SimCluster

log = logging.getLogger("kvroute.server")


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(4096)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class RouterServer:
    """The router (and its ``--sim`` engines) in the running event loop."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.url = ""
        self.sim: SimCluster | None = None
        self._state: RouterState | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> RouterState:
        assert self._state is not None, "the router is not started"
        return self._state

    async def __aenter__(self) -> RouterServer:
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
        files = await asyncio.to_thread(load_tokenizer_files, c.tokenizer, c.chat_template)
        encoder = await asyncio.to_thread(PromptEncoder, files, c.tokenizer_backend)
        specs = list(c.backend_specs)
        if c.sim:
            specs = await self._start_sim(encoder)
        fleet = Fleet(c)
        metrics = Metrics(fleet)
        limiter = Limiter(c.max_concurrency, c.max_queue, c.queue_timeout_s)
        proxy = Proxy(fleet, c, metrics, limiter)
        self._state = RouterState(c, fleet, encoder, metrics, limiter, proxy, time.time())
        for spec in specs:
            await fleet.add(spec)
        sock = listen(c.host, c.port)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        if c.fanout:
            from kvroute.peers import PeerFanout

            fleet.peers = PeerFanout(c, fleet, c.router_name or self.url.removeprefix("http://"))
            try:
                await fleet.peers.start()
            except BaseException:
                sock.close()
                raise
        self._server = uvicorn.Server(
            uvicorn.Config(
                build_app(self._state),
                lifespan="off",
                log_config=None,
                log_level=c.log_level,
                access_log=False,
                timeout_graceful_shutdown=2,
                timeout_keep_alive=30,
            )
        )
        # Server._serve is serve() without taking over SIGINT/SIGTERM: the embedding program
        # (or `kvroute serve`) owns the signals and the loop.
        self._task = asyncio.get_running_loop().create_task(self._server._serve([sock]), name="kvroute-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)
        log.info(
            "kvroute serving %s/v1 with %d backend(s), tokenizer %s", self.url, len(specs), encoder.backend
        )

    async def _start_sim(self, encoder: PromptEncoder) -> list[BackendSpec]:
        from kvroute.sim import EngineConfig, SimCluster, SimConfig

        c = self.config
        engine = EngineConfig(block_size=c.block_size)
        if c.sim_preset is not None:
            engine = EngineConfig(preset=c.sim_preset, block_size=c.block_size)
        extra: dict[str, Any] = {"max_model_len": c.max_model_len} if c.max_model_len else {}
        sim_config = SimConfig(
            model=c.served_model or "kvroute-sim",
            replicas=c.sim,
            base_port=0,
            kv_events_port_base=0,
            replay_port_base=0,
            time_scale=c.sim_time_scale,
            engine=engine,
            **extra,
        )
        self.sim = SimCluster(sim_config, tokenizer=encoder.reference, template=encoder.template)
        await self.sim.start()
        return [
            BackendSpec(
                url=url,
                name=f"sim-{i}",
                events=events if c.kv_events else None,
                replay=replay if c.kv_events else None,
            )
            for i, (url, events, replay) in enumerate(
                zip(self.sim.urls, self.sim.event_endpoints, self.sim.replay_endpoints, strict=True)
            )
        ]

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._task
            self._task = None
        if self._state is not None:
            await self._state.proxy.aclose()
            await self._state.fleet.aclose()
        if self.sim is not None:
            await self.sim.aclose()
            self.sim = None


async def serve(config: RouterConfig, stop: asyncio.Event | None = None) -> None:
    """Runs the router until ``stop`` is set or SIGINT/SIGTERM arrives."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with RouterServer(config) as router:
        print(f"kvroute serve: OpenAI API at {router.url}/v1", flush=True)
        for b in router.state.fleet.backends.values():
            print(
                f"  backend {b.name}: {b.url}  events {b.spec.events or '-'}  replay {b.spec.replay or '-'}",
                flush=True,
            )
        await stop.wait()
