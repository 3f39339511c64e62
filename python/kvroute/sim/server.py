"""The HTTP surface of one replica: vLLM's OpenAI-compatible routes, as a Starlette app.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET /metrics``, ``GET /version``, and
for tests ``GET|POST /admin/fault``. In front of them sits the token-handoff middleware real vLLM
loads (:mod:`kvroute.vllm`, with ``GET /kvroute/handoff``) unless ``handoff`` is off.
``X-Request-Id`` is honoured (it names the response ids) and echoed; one is generated when absent.
Errors have OpenAI-style bodies; validation errors are 400. While a fault makes the replica
unavailable (``unavailable`` or a crash), the inference routes and ``/health`` answer 503;
``/metrics`` and ``/admin`` keep answering.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvroute.chat_template import ChatTemplateError
from kvroute.sim import generate
from kvroute.sim.faults import FaultError
from kvroute.sim.protocol import ApiError, bad_request
from kvroute.sim.replica import Replica
from kvroute.sim.responses import models_response
from kvroute.vllm.middleware import TokenHandoffMiddleware

VLLM_VERSION = "0.33.0"
"""The vLLM release whose wire behaviour the simulator follows."""

Handler = Callable[[Replica, Request, object], Awaitable[Response]]


class RequestIdMiddleware:
    """Reads ``X-Request-Id`` (or makes one) into the scope and echoes it on the response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                rid = value.decode("latin-1")
                break
        rid = rid or uuid.uuid4().hex
        scope["kvroute.request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        await self.app(scope, receive, send_with_id)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _json_body(replica: Replica, request: Request) -> object:
    limit = replica.config.max_body_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"The request body exceeds {limit} bytes.")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"The request body exceeds {limit} bytes.")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"Invalid JSON in the request body: {e}") from None


def build_app(replica: Replica) -> Starlette:
    """The ASGI app of ``replica``."""
    created = int(time.time())

    def inference(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                if replica.unavailable():
                    raise ApiError(503, "The engine is unavailable (injected fault).")
                body = await _json_body(replica, request)
                return await handler(replica, request, body)
            except ApiError as e:
                return _error(e)

        return endpoint

    async def models(request: Request) -> Response:
        return JSONResponse(models_response(replica.config.model, replica.config.max_model_len, created))

    async def health(request: Request) -> Response:
        return Response(status_code=503 if replica.unavailable() else 200)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(replica.metrics_text(), media_type="text/plain; version=0.0.4")

    async def version(request: Request) -> Response:
        return JSONResponse({"version": VLLM_VERSION})

    async def tokenize(replica: Replica, request: Request, body: object) -> Response:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        replica.check_model(body.get("model"))
        tok = replica.tokenizer
        if "messages" in body:
            try:
                text = replica.template.render(
                    body["messages"],
                    tools=body.get("tools"),
                    add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                )
            except ChatTemplateError as e:
                raise bad_request(str(e), "messages") from None
            special = bool(body.get("add_special_tokens", False))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
            special = bool(body.get("add_special_tokens", True))
        else:
            raise bad_request("either 'prompt' (a string) or 'messages' is required", "prompt")
        ids = await tok.encode_async(text, add_special_tokens=special)
        strs = [tok.id_to_token(i) or "" for i in ids] if body.get("return_token_strs") else None
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": replica.config.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def detokenize(replica: Replica, request: Request, body: object) -> Response:
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise bad_request("'tokens' must be a list of token ids", "tokens")
        if any(t < 0 or t >= replica.tokenizer.vocab_size for t in tokens):
            raise bad_request("a token id is out of vocabulary", "tokens")
        return JSONResponse({"prompt": replica.tokenizer.decode(tokens)})

    async def admin_fault(request: Request) -> Response:
        if request.method == "POST":
            try:
                body = await _json_body(replica, request)
                if not isinstance(body, dict) or not isinstance(body.get("kind"), str):
                    raise bad_request("expected {'kind': ..., 'value': ...}", "kind")
                value = body.get("value")
                if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
                    raise bad_request("'value' must be a number or null", "value")
                replica.apply_fault(body["kind"], None if value is None else float(value))
            except FaultError as e:
                return _error(bad_request(str(e), "kind"))
            except ApiError as e:
                return _error(e)
        return JSONResponse(replica.fault_state())

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", inference(generate.completions), methods=["POST"]),
        Route("/v1/chat/completions", inference(generate.chat_completions), methods=["POST"]),
        Route("/tokenize", inference(tokenize), methods=["POST"]),
        Route("/detokenize", inference(detokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/admin/fault", admin_fault, methods=["GET", "POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={404: _not_found, 405: _not_allowed})
    if replica.handoff is not None:
        # The engine-side plugin real vLLM loads with --middleware: the same code path.
        app.add_middleware(TokenHandoffMiddleware, receiver=replica.handoff)
    app.add_middleware(RequestIdMiddleware)
    return app


async def _not_found(request: Request, exc: Any) -> Response:
    return _error(ApiError(404, f"Not found: {request.url.path}"))


async def _not_allowed(request: Request, exc: Any) -> Response:
    return JSONResponse(ApiError(405, "Method not allowed").body(), status_code=405)


class _CrashFilter(logging.Filter):
    """Keeps uvicorn from logging a traceback for each stream an injected crash cuts."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, generate.EngineCrashedError):
                return False
            if isinstance(exc, BaseExceptionGroup) and any(
                isinstance(e, generate.EngineCrashedError) for e in exc.exceptions
            ):
                return False
            exc = exc.__cause__ or exc.__context__
        return True


def quiet_crash_logs() -> None:
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _CrashFilter) for f in logger.filters):
        logger.addFilter(_CrashFilter())
