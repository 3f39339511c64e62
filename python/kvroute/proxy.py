"""Forwarding one request: select-and-reserve, send upstream, stream back, report the lifecycle.

:meth:`Proxy.call` returns an ASGI app that runs the request to its end while watching for the
client going away. For each attempt:

1. ``Scheduler.select_and_reserve`` (one atomic call: hash, match, score, book) picks an engine,
   excluding the ones that already failed this request. The reservation is released in a
   ``finally``: completion, upstream error, timeout, client disconnect and cancellation all end
   there, so no reservation outlives its request. With peer fan-out, the reservation and each
   lifecycle step are also queued for the peer routers (:mod:`kvroute.peers`; never awaited).
2. With the token handoff, the prompt's ids go to the engine's token channel first
   (:mod:`kvroute.handoff`; never blocking). The client's body is sent unchanged (with
   ``X-Request-Id``, the handoff key if one was sent, and ``X-data-parallel-rank`` for a
   backend with several DP ranks) over a pooled ``aiohttp`` session (one keep-alive pool for all
   backends; ``httpx.AsyncClient`` was measured first and its pool's per-request scans over all
   connections capped one router at about 300 requests/s with 32 connections in flight).
3. Until a byte has gone to the client, a failed backend (connection refused, a 5xx answer, no
   response or first chunk within the timeout, a cut connection) is excluded and the request is
   routed again, at most ``max_retries`` times; a refused connection also marks the backend
   unhealthy until its health check passes. A 4xx answer is the client's: it is passed through.
4. A stream's first chunk is read before the client's response starts (so that a backend failing
   before its first token is retried too); it reports ``prefill_done``; each further SSE event
   counts a generated token (``decode_progress`` every :data:`PROGRESS_EVERY`). A failure after
   that ends the stream with an OpenAI-style error event and ``data: [DONE]``.
   A non-streaming request reports ``prefill_done`` when its estimated TTFT has passed.
5. ``usage.prompt_tokens_details.cached_tokens``, when the engine reports it, is compared with the
   index's prediction (metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvroute._native import Decision, NoEligibleWorkerError, SaturatedError, block_hashes
from kvroute.config import RouterConfig
from kvroute.fleet import Backend, Engine, Fleet
from kvroute.prompts import Prompt
from kvroute.server.errors import error_body
from kvroute.server.limits import Busy, Limiter
from kvroute.server.metrics import Metrics

log = logging.getLogger("kvroute.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROGRESS_EVERY = 16
"""Generated tokens between two ``decode_progress`` reports (one KV block at the default size)."""
_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
_JSON = [(b"content-type", b"application/json")]


@dataclass(slots=True)
class Job:
    """One client request, parsed and tokenized, ready to be routed."""

    route: str
    body: bytes
    stream: bool
    prompt: Prompt
    expected_output_tokens: int
    salt: str | None
    lora: str | None
    request_id: str
    headers: dict[str, str]
    arrived: float = field(default_factory=time.perf_counter)
    handoff: bool = False
    """The prompt's ids may be handed to the engine (:mod:`kvroute.handoff`): exact, one prompt,
    and not already token ids."""


@dataclass(slots=True)
class Failure:
    """Why an attempt failed before anything reached the client."""

    reason: str
    status: int
    message: str


class Proxy:
    def __init__(self, fleet: Fleet, config: RouterConfig, metrics: Metrics, limiter: Limiter) -> None:
        self.fleet = fleet
        self.config = config
        self.metrics = metrics
        self.limiter = limiter
        self.decisions: deque[dict[str, Any]] = deque(maxlen=config.recent_decisions)
        c = config
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
            timeout=aiohttp.ClientTimeout(
                total=None, connect=c.connect_timeout_s, sock_read=c.read_timeout_s
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        )

    async def aclose(self) -> None:
        await self.session.close()

    def call(self, job: Job) -> ProxyCall:
        return ProxyCall(self, job)


async def _disconnected(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def send_error(
    send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [*_JSON, *(headers or [])]})
    await send({"type": "http.response.body", "body": error_body(status, message)})


class ProxyCall:
    """The ASGI app that answers one proxied request."""

    def __init__(self, proxy: Proxy, job: Job) -> None:
        self.p = proxy
        self.job = job
        self.status = 0
        self.backend = "none"
        self.client_gone = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.create_task(self._run(send))
        gone = asyncio.create_task(_disconnected(receive))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                # The client went away (or the server is stopping): end the request; its
                # finally blocks release the reservation and close the upstream response.
                self.client_gone = gone.done()
                work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work

    async def _run(self, send: Send) -> None:
        p = self.p
        try:
            try:
                await p.limiter.acquire()
            except Busy:
                self.status = 429
                retry = [(b"retry-after", str(p.config.retry_after_s).encode())]
                await send_error(send, 429, "the router is at its concurrency limit; retry later", retry)
                return
            try:
                await self._route(send)
            finally:
                p.limiter.release()
        finally:
            if self.client_gone:
                p.metrics.disconnects.inc()
                self.status = 499
            p.metrics.requests.labels(self.job.route, str(self.status), self.backend).inc()

    async def _route(self, send: Send) -> None:
        p, job = self.p, self.job
        sched = p.fleet.scheduler
        excluded: list[int] = []
        failure: Failure | None = None
        # During a burst of concurrent decisions at peer routers, wait (a few ms) for this
        # router's next decision window, so the decision sees the peers' previous ones.
        if p.fleet.peers is not None:
            wait = sched.pace()
            if wait > 0.0:
                await asyncio.sleep(wait)
        for attempt in range(p.config.max_retries + 1):
            t0 = time.perf_counter()
            try:
                d = sched.select_and_reserve(
                    job.prompt.tokens,
                    expected_output_tokens=job.expected_output_tokens,
                    lora=job.lora,
                    salt=job.salt,
                    exclude=excluded,
                )
            except NoEligibleWorkerError:
                break
            except SaturatedError:
                self.status = 429
                retry = [(b"retry-after", str(p.config.retry_after_s).encode())]
                await send_error(send, 429, "every backend is at its in-flight limit; retry later", retry)
                return
            try:
                now = time.perf_counter()
                p.metrics.decide.observe(now - t0)
                entry = p.fleet.engine(d.worker)
                if entry is None:  # removed since the decision
                    excluded.append(d.worker)
                    continue
                backend, engine = entry
                self.backend = backend.name
                peers = p.fleet.peers
                if peers is not None:
                    hashes = block_hashes(job.prompt.tokens, p.config.block_size, job.lora, job.salt)
                    peers.reserved(
                        d, backend.name, engine.rank, job.prompt.count, job.expected_output_tokens, hashes
                    )
                if attempt == 0:
                    p.metrics.total.observe(now - job.arrived)
                self._record(d, backend, engine, attempt)
                failure = await self._attempt(send, d, backend, engine)
                if failure is None:
                    return
                log.info(
                    "request %s: backend %s failed before answering (%s: %s); re-routing",
                    job.request_id,
                    backend.name,
                    failure.reason,
                    failure.message,
                )
                p.metrics.retries.labels(backend.name, failure.reason).inc()
                excluded.append(d.worker)
            finally:
                self._release(d.reservation)
        if failure is None:
            self.status = 503
            await send_error(send, 503, "no healthy backend is available")
            return
        self.status = failure.status
        await send_error(send, failure.status, f"all backends failed; last error: {failure.message}")

    # The lifecycle goes to the scheduler and, with fan-out, to the peer routers.

    def _prefill_done(self, reservation: int) -> None:
        self.p.fleet.scheduler.prefill_done(reservation)
        if self.p.fleet.peers is not None:
            self.p.fleet.peers.prefill_done(reservation)

    def _progress(self, reservation: int, generated: int) -> None:
        self.p.fleet.scheduler.decode_progress(reservation, generated)
        if self.p.fleet.peers is not None:
            self.p.fleet.peers.progress(reservation, generated)

    def _release(self, reservation: int) -> None:
        self.p.fleet.scheduler.release(reservation)
        if self.p.fleet.peers is not None:
            self.p.fleet.peers.finished(reservation)

    def _record(self, d: Decision, backend: Backend, engine: Engine, attempt: int) -> None:
        p, job = self.p, self.job
        bs = p.config.block_size
        entry = {
            "time": time.time(),
            "request_id": job.request_id,
            "backend": backend.name,
            "rank": engine.rank,
            "attempt": attempt,
            "prompt_tokens": job.prompt.count,
            "exact_prompt": job.prompt.exact,
            "cached_tokens_gpu": min(d.gpu_blocks * bs, job.prompt.count),
            "cached_tokens_cpu": d.cpu_blocks * bs,
            "prefill_tokens": d.prefill_tokens,
            "queued_prefill_tokens": d.queued_prefill_tokens,
            "active": d.active,
            "decoding": d.decoding,
            "kv_usage": round(d.kv_usage, 4),
            "candidates": d.candidates,
            "score": d.score,
            "est_ttft_s": d.est_ttft_s,
        }
        p.decisions.append(entry)
        p.metrics.prompt_tokens.labels(backend.name).inc(job.prompt.count)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s", entry, extra={"decision": entry})

    def _headers(self, backend: Backend, engine: Engine) -> dict[str, str]:
        headers = dict(self.job.headers)
        if backend.spec.dp > 1:
            headers["x-data-parallel-rank"] = str(engine.rank)
        return headers

    async def _attempt(self, send: Send, d: Decision, backend: Backend, engine: Engine) -> Failure | None:
        p, job = self.p, self.job
        resp: aiohttp.ClientResponse | None = None
        timer: asyncio.TimerHandle | None = None
        finished = False
        try:
            first = b""
            try:
                limit = p.config.first_byte_timeout_s if job.stream else None
                async with asyncio.timeout(limit):
                    upstream = self._headers(backend, engine)
                    if p.fleet.handoff.active:
                        p.fleet.handoff.offer(backend.name, job.prompt.tokens, job.handoff, upstream)
                    resp = await p.session.post(backend.url + job.route, data=job.body, headers=upstream)
                    if resp.status >= 500:
                        body = await resp.read()
                        finished = True
                        text = body[:300].decode(errors="replace")
                        return Failure("http_" + str(resp.status), resp.status, text)
                    if job.stream and resp.status == 200:
                        first = await resp.content.readany()
                        if not first:
                            return Failure("empty_stream", 502, "the backend ended the stream at once")
                    else:
                        if resp.status == 200:
                            ttft = max(d.est_ttft_s, 0.0)
                            loop = asyncio.get_running_loop()
                            timer = loop.call_later(ttft, self._prefill_done, d.reservation)
                        await resp.read()
                        finished = True
            except aiohttp.ClientConnectorError as e:
                p.fleet.report_unreachable(d.worker, f"{type(e).__name__}: {e}")
                return Failure("connect", 502, f"cannot connect to {backend.name}: {e}")
            except TimeoutError:
                return Failure("timeout", 504, f"{backend.name} did not answer in time")
            except aiohttp.ClientError as e:
                return Failure("upstream", 502, f"{backend.name}: {type(e).__name__}: {e}")
            self.status = resp.status
            headers = [
                (b"content-type", resp.headers.get("content-type", "application/json").encode()),
                (b"x-request-id", job.request_id.encode()),
                (b"x-kvroute-backend", backend.name.encode()),
            ]
            if not job.stream or resp.status != 200:
                body = await resp.read()
                finished = True
                if resp.status == 200:
                    self._usage(d, backend, body)
                headers.append((b"content-length", str(len(body)).encode()))
                await send({"type": "http.response.start", "status": resp.status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return None
            headers.append((b"cache-control", b"no-cache"))
            finished = await self._stream(send, d, backend, resp, first, headers)
            return None
        finally:
            if timer is not None:
                timer.cancel()
            if resp is not None:
                if finished:
                    resp.release()  # back to the pool
                else:
                    resp.close()  # the engine sees the connection drop and aborts the request

    async def _stream(
        self,
        send: Send,
        d: Decision,
        backend: Backend,
        resp: aiohttp.ClientResponse,
        first: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> bool:
        """Streams the rest of the response; returns whether the upstream body ended cleanly."""
        res = d.reservation
        self._prefill_done(res)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        generated = first.count(b"data:")
        reported = 0
        last = first
        usage = first if b"cached_tokens" in first else b""
        await send({"type": "http.response.body", "body": first, "more_body": True})
        clean = True
        try:
            async for chunk in resp.content.iter_any():
                generated += chunk.count(b"data:")
                if generated - reported >= PROGRESS_EVERY:
                    self._progress(res, generated)
                    reported = generated
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                last = chunk
                if b"cached_tokens" in chunk:
                    usage = chunk
        except (aiohttp.ClientError, TimeoutError) as e:
            clean = False
            self.p.metrics.stream_errors.labels(backend.name).inc()
            log.warning("request %s: %s failed mid-stream: %r", self.job.request_id, backend.name, e)
            sep = b"" if last.endswith(b"\n\n") else b"\n\n"
            err = error_body(502, f"the backend failed mid-stream: {type(e).__name__}")
            await send(
                {
                    "type": "http.response.body",
                    "body": sep + b"data: " + err + b"\n\ndata: [DONE]\n\n",
                    "more_body": True,
                }
            )
            self.status = 502
        await send({"type": "http.response.body", "body": b""})
        if usage:
            self._usage(d, backend, usage)
        return clean

    def _usage(self, d: Decision, backend: Backend, body: bytes) -> None:
        m = _CACHED.search(body)
        if m is None:
            return
        p = self.p
        predicted = min((d.gpu_blocks + d.cpu_blocks) * p.config.block_size, self.job.prompt.count)
        p.metrics.cache_reports.labels(backend.name).inc()
        p.metrics.actual_cached.labels(backend.name).inc(int(m.group(1)))
        p.metrics.predicted_cached.labels(backend.name).inc(predicted)
