"""The Starlette app: OpenAI-compatible routes, health, metrics, status and admin.

Client routes (``/v1/...``) take ``Authorization: Bearer KEY`` when ``api_keys`` are configured;
``/admin/...`` takes the separate ``admin_key`` (and is disabled without one). ``/health``,
``/metrics``, ``/status`` and the status page ``/`` are open, as monitoring endpoints usually are.
"""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from kvroute.config import RouterConfig
from kvroute.fleet import Fleet
from kvroute.prompts import Prompt, PromptEncoder
from kvroute.proxy import Job, Proxy, Receive, Scope, Send
from kvroute.server import admin, status
from kvroute.server.errors import ApiError, bad_request
from kvroute.server.limits import Limiter
from kvroute.server.metrics import CONTENT_TYPE, Metrics
from kvroute.server.schema import ParsedRequest, decode_json, parse_chat, parse_completion


@dataclass(slots=True)
class RouterState:
    """Everything the routes share."""

    config: RouterConfig
    fleet: Fleet
    encoder: PromptEncoder
    metrics: Metrics
    limiter: Limiter
    proxy: Proxy
    started: float


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def check_key(request: Request, keys: tuple[str, ...]) -> None:
    """401 unless the request carries one of ``keys`` (no keys: open)."""
    if not keys:
        return
    token = _bearer(request)
    if token is None or not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
        raise ApiError(401, "invalid or missing API key", headers={"www-authenticate": "Bearer"})


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, 413 past ``limit`` bytes (checked on Content-Length and as it streams)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is larger than {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


class InferenceEndpoint:
    """``POST /v1/chat/completions`` and ``POST /v1/completions`` (an ASGI app: the proxied
    response runs under the same ``receive``, which tells when the client goes away)."""

    def __init__(self, state: RouterState, kind: Literal["chat", "completion"]) -> None:
        self.state = state
        self.kind = kind
        self.path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.perf_counter()
        request = Request(scope, receive)
        try:
            job = await self._prepare(request, arrived)
        except ApiError as e:
            self.state.metrics.requests.labels(self.path, str(e.status), "none").inc()
            await e.response()(scope, receive, send)
            return
        except ClientDisconnect:
            self.state.metrics.requests.labels(self.path, "499", "none").inc()
            return
        await self.state.proxy.call(job)(scope, receive, send)

    async def _prepare(self, request: Request, arrived: float) -> Job:
        s = self.state
        c = s.config
        if request.method != "POST":
            raise ApiError(405, "method not allowed")
        check_key(request, c.api_keys)
        raw = await read_body(request, c.max_body_bytes)
        body = decode_json(raw)
        parsed = parse_chat(body) if self.kind == "chat" else parse_completion(body)
        served = s.fleet.served_models()
        lora = parsed.model if s.fleet.is_lora(parsed.model) else None
        if parsed.model is not None and served and parsed.model not in served and lora is None:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", param="model")
        prompt = await self._prompt(parsed)
        s.metrics.tokenize.observe(prompt.tokenize_s)
        if not prompt.exact:
            s.metrics.untokenized.inc()
        expected = self._check_length(parsed, prompt)
        rid = request.headers.get("x-request-id") or f"kvr-{uuid.uuid4().hex}"
        headers = {"content-type": "application/json", "x-request-id": rid}
        if c.backend_api_key is not None:
            headers["authorization"] = f"Bearer {c.backend_api_key}"
        elif not c.api_keys and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        return Job(
            route=self.path,
            body=raw,
            stream=parsed.stream,
            prompt=prompt,
            expected_output_tokens=expected,
            salt=parsed.salt,
            lora=lora,
            request_id=rid,
            headers=headers,
            arrived=arrived,
            handoff=prompt.exact
            and parsed.prompts == 1
            and (parsed.reused_ids is None if parsed.kind == "chat" else parsed.prompt_text is not None),
        )

    async def _prompt(self, parsed: ParsedRequest) -> Prompt:
        enc = self.state.encoder
        if parsed.kind == "chat":
            if parsed.reused_ids is not None:
                return enc.from_ids(parsed.reused_ids)
            return await enc.chat(
                parsed.messages,
                tools=parsed.tools,
                add_generation_prompt=parsed.add_generation_prompt,
                add_special_tokens=parsed.add_special_tokens,
                non_text=parsed.non_text,
            )
        if parsed.prompt_ids is not None:
            return enc.from_ids(parsed.prompt_ids)
        assert parsed.prompt_text is not None
        return await enc.completion(parsed.prompt_text, add_special_tokens=parsed.add_special_tokens)

    def _check_length(self, parsed: ParsedRequest, prompt: Prompt) -> int:
        """vLLM's context-length checks (400), on exact prompts; returns the expected output."""
        limit = self.state.fleet.max_model_len()
        n = prompt.count
        default = self.state.config.default_max_tokens
        if limit is None or not prompt.exact:
            return parsed.max_tokens or default
        if n >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{n} input tokens. Please reduce the length of the input.",
                "messages" if parsed.kind == "chat" else "prompt",
            )
        if parsed.max_tokens is not None and n + parsed.max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + parsed.max_tokens} tokens ({n} in the prompt, {parsed.max_tokens} in the "
                "completion). Please reduce the length of the prompt or completion.",
                "max_tokens",
            )
        return min(parsed.max_tokens or default, limit - n)


def _handler(
    state: RouterState, fn: Callable[[RouterState, Request], Awaitable[Response]]
) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        try:
            return await fn(state, request)
        except ApiError as e:
            return e.response()

    return endpoint


async def models(state: RouterState, request: Request) -> Response:
    check_key(request, state.config.api_keys)
    limit = state.fleet.max_model_len()
    data: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "kvroute",
            "root": name,
            "parent": None,
            "max_model_len": limit,
        }
        for name in state.fleet.served_models()
    ]
    return JSONResponse({"object": "list", "data": data})


async def health(state: RouterState, request: Request) -> Response:
    healthy = sum(b.healthy for b in state.fleet.backends.values())
    body = {"status": "ok" if healthy else "unavailable", "healthy_backends": healthy}
    return JSONResponse(body, status_code=200 if healthy else 503)


async def metrics(state: RouterState, request: Request) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def status_json(state: RouterState, request: Request) -> Response:
    return JSONResponse(status.snapshot(state))


async def status_page(state: RouterState, request: Request) -> Response:
    return HTMLResponse(status.PAGE)


def build_app(state: RouterState) -> Starlette:
    def h(
        fn: Callable[[RouterState, Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        return _handler(state, fn)

    routes = [
        Route("/v1/chat/completions", InferenceEndpoint(state, "chat"), methods=["POST"]),
        Route("/v1/completions", InferenceEndpoint(state, "completion"), methods=["POST"]),
        Route("/v1/models", h(models), methods=["GET"]),
        Route("/health", h(health), methods=["GET"]),
        Route("/metrics", h(metrics), methods=["GET"]),
        Route("/status", h(status_json), methods=["GET"]),
        Route("/", h(status_page), methods=["GET"]),
        Route("/admin/backends", h(admin.list_backends), methods=["GET"]),
        Route("/admin/backends", h(admin.add_backend), methods=["POST"]),
        Route("/admin/backends/{name:path}", h(admin.remove_backend), methods=["DELETE"]),
    ]
    app = Starlette(routes=routes)

    async def not_found(request: Request, exc: Exception) -> Response:
        return ApiError(404, f"no route {request.url.path}").response()

    async def not_allowed(request: Request, exc: Exception) -> Response:
        return ApiError(405, f"method {request.method} not allowed on {request.url.path}").response()

    app.add_exception_handler(404, not_found)
    app.add_exception_handler(405, not_allowed)
    return app
