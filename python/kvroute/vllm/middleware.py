"""The ASGI middleware vLLM loads: ``vllm serve MODEL --middleware kvroute.vllm.TokenHandoffMiddleware``.

For ``POST /v1/chat/completions`` and ``POST /v1/completions`` carrying ``X-Kvroute-Token-Key``
(and ``X-Kvroute-Token-Count``), it reads the body, takes the key's token ids from the
:class:`~kvroute.vllm.receiver.TokenReceiver`'s store (waiting a moment if they have not arrived)
and rewrites the body so that vLLM prefills those ids instead of templating and tokenizing
(:mod:`kvroute.vllm.rewrite`). Every failure -- no tokens in time, stale or malformed tokens, a
body that cannot take them, a body too large to buffer -- passes the request on untouched. The
response says what happened in ``X-Kvroute-Handoff`` (``used``, ``missing``, ``malformed``,
``not_applicable``, ``too_large``, or ``off`` when the channel is not running). Other requests
are passed through without any work.

``GET /kvroute/handoff`` answers the channel's endpoint, limits and counters: that is how the
router discovers where to send tokens.

vLLM constructs the middleware with the app alone, so its settings come from ``KVROUTE_HANDOFF_*``
variables, and every instance in a process with the same settings shares one receiver (building
the app twice binds once). ``kvroute sim`` passes each replica's receiver explicitly.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvroute.vllm.receiver import HandoffSettings, TokenReceiver
from kvroute.vllm.rewrite import ROUTES, Kind, decode_ids, rewrite

log = logging.getLogger("kvroute.vllm")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KEY_HEADER = b"x-kvroute-token-key"
COUNT_HEADER = b"x-kvroute-token-count"
OUTCOME_HEADER = b"x-kvroute-handoff"
INFO_PATH = "/kvroute/handoff"

_shared: dict[HandoffSettings, TokenReceiver] = {}


def shared_receiver(settings: HandoffSettings) -> TokenReceiver:
    """This process's receiver for ``settings`` (one per distinct settings)."""
    receiver = _shared.get(settings)
    if receiver is None:
        receiver = _shared[settings] = TokenReceiver(settings)
    return receiver


class TokenHandoffMiddleware:
    """Rewrites requests whose tokens the router handed off; see the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        receiver: TokenReceiver | None = None,
        settings: HandoffSettings | None = None,
    ) -> None:
        self.app = app
        if receiver is None:
            settings = settings or HandoffSettings.from_env()
            receiver = shared_receiver(settings) if settings.enabled else None
        self.receiver = receiver

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        r = self.receiver
        kind = scope["type"]
        if r is None or kind not in ("http", "lifespan"):
            await self.app(scope, receive, send)
            return
        await r.start()  # idempotent; the first call (vLLM's lifespan startup) binds
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        if method == "GET" and path == INFO_PATH:
            await _json(send, 200 if r.endpoint else 503, r.info())
            return
        route = ROUTES.get(path)
        if method != "POST" or route is None:
            await self.app(scope, receive, send)
            return
        key = count = None
        for name, value in scope["headers"]:
            if name == KEY_HEADER:
                key = value
            elif name == COUNT_HEADER:
                count = value
        if key is None:
            await self.app(scope, receive, send)
            return
        if r.endpoint is None:  # the channel could not bind (or was closed): nothing can arrive
            await self.app(scope, receive, _tagged(send, b"off"))
            return
        await self._handoff(r, route, key, count, scope, receive, send)

    async def _handoff(
        self,
        r: TokenReceiver,
        route: Kind,
        key: bytes,
        count_raw: bytes | None,
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        limit = r.settings.max_body_bytes
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            r.store.stats.not_applicable += 1
            await self.app(scope, receive, _tagged(send, b"too_large"))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:  # no content-length, and too large to buffer: pass it on
                r.store.stats.not_applicable += 1
                replay = _replay([*chunks], receive, more=message.get("more_body", False))
                await self.app(scope, replay, _tagged(send, b"too_large"))
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        outcome, new_body = await self._rewrite(r, route, key, count_raw, body)
        if new_body is not body:
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            headers.append((b"content-length", str(len(new_body)).encode()))
            scope = {**scope, "headers": headers}
        await self.app(scope, _replay([new_body], receive, more=False), _tagged(send, outcome))

    async def _rewrite(
        self, r: TokenReceiver, route: Kind, key: bytes, count_raw: bytes | None, body: bytes
    ) -> tuple[bytes, bytes]:
        stats = r.store.stats
        payload = await r.store.take(key, r.settings.wait_s)
        if payload is None:
            return b"missing", body
        count = int(count_raw) if count_raw is not None and count_raw.isdigit() else None
        ids = decode_ids(payload, count)
        if ids is None or (count_raw is not None and count is None):
            stats.malformed += 1
            return b"malformed", body
        new_body = rewrite(route, body, ids)
        if new_body is None:
            stats.not_applicable += 1
            return b"not_applicable", body
        stats.used += 1
        return b"used", new_body


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            value: bytes = v
            return value
    return None


def _replay(chunks: list[bytes], receive: Receive, *, more: bool) -> Receive:
    """A ``receive`` that yields the buffered body, then whatever the client sends next (the rest
    of the body when ``more``, else only its disconnect)."""
    pending = list(chunks)

    async def replay() -> Message:
        if pending:
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending) or more}
        return await receive()

    return replay


def _tagged(send: Send, outcome: bytes) -> Send:
    async def tagged(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), (OUTCOME_HEADER, outcome)]
        await send(message)

    return tagged


async def _json(send: Send, status: int, body: object) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
