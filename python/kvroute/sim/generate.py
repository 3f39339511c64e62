"""``/v1/completions`` and ``/v1/chat/completions``: prompts in, engine requests, text out.

Generated text is the detokenization of the engine's deterministic token ids, streamed through an
incremental detokenizer so a multi-byte character split across tokens is never emitted half.
A client that disconnects has its engine requests aborted; an injected crash cuts streams by
raising :class:`EngineCrashedError` after the response has started, which makes the server close
the connection without the final chunk -- what a client of a dying vLLM sees.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvroute.sim.engine_loop import Crashed, Output, RequestHandle
from kvroute.sim.protocol import ApiError, Sampling, bad_request, parse_chat, parse_completion
from kvroute.sim.replica import Replica
from kvroute.sim.responses import (
    DONE,
    Envelope,
    Usage,
    chat_delta_chunk,
    chat_response,
    chat_usage_chunk,
    completion_choice,
    completion_chunk,
    completion_response,
    sse,
)
from kvroute.tokenization import IncrementalDetokenizer

SSE_HEADERS = {"Cache-Control": "no-cache"}
CLIENT_CLOSED = 499  # nginx's code: nobody reads it, the client is gone


class EngineCrashedError(Exception):
    """The engine died under a request (injected crash or restart)."""


@dataclass(slots=True)
class _Track:
    """Per-prompt progress of one HTTP request."""

    handle: RequestHandle
    detok: IncrementalDetokenizer
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None

    def take(self, out: Output) -> str:
        """Folds one output in; returns the new text."""
        self.usage.prompt_tokens = out.prompt_tokens
        self.usage.cached_tokens = out.num_cached_tokens
        self.usage.completion_tokens += len(out.new_token_ids)
        if out.finished:
            self.finish_reason = out.finish_reason or "stop"
        return self.detok.push(out.new_token_ids, final=out.finished)


def request_id(request: Request) -> str:
    rid = request.scope.get("kvroute.request_id")
    return rid if isinstance(rid, str) else ""


async def _next(handle: RequestHandle) -> Output:
    item = await handle.queue.get()
    if isinstance(item, Crashed):
        raise EngineCrashedError("the engine crashed")
    return item


async def _merged(tracks: Sequence[_Track]) -> AsyncIterator[tuple[int, Output]]:
    """Outputs of all tracks in arrival order, until each has finished."""
    if len(tracks) == 1:
        while True:
            out = await _next(tracks[0].handle)
            yield 0, out
            if out.finished:
                return
    pending = {asyncio.ensure_future(_next(t.handle)): i for i, t in enumerate(tracks)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                out = fut.result()
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(_next(tracks[i].handle))] = i
    finally:
        for fut in pending:
            fut.cancel()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, tracks: Sequence[_Track]) -> bool:
    """Runs a non-streamed request to the end; False if the client left first."""

    async def consume() -> None:
        async for i, out in _merged(tracks):
            tracks[i].take(out)

    work = asyncio.ensure_future(consume())
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            return False
        work.result()
        return True
    finally:
        work.cancel()
        watch.cancel()


def _submit(
    replica: Replica, prompts: Sequence[tuple[list[int], int]], s: Sampling, tag: str
) -> list[_Track]:
    tracks: list[_Track] = []
    for ids, max_tokens in prompts:
        try:
            handle = replica.loop.submit(
                ids,
                max_tokens,
                tag=tag,
                salt=s.cache_salt,
                ignore_eos=s.ignore_eos,
                eos_token_id=replica.eos_token_id,
            )
        except ValueError as e:  # the engine refuses it (e.g. it can never fit in the KV cache)
            _abort_all(replica, tracks)
            raise bad_request(str(e), "prompt") from None
        tracks.append(_Track(handle, replica.tokenizer.detokenizer()))
    return tracks


def _abort_all(replica: Replica, tracks: Sequence[_Track]) -> None:
    for t in tracks:
        replica.loop.abort(t.handle)


def _total(tracks: Sequence[_Track]) -> Usage:
    total = Usage()
    for t in tracks:
        total.add(t.usage)
    return total


async def completions(replica: Replica, request: Request, body: object) -> Response:
    req = parse_completion(body)
    replica.check_model(req.model)
    prompts: list[tuple[list[int], int]] = []
    for p in req.prompts:
        if isinstance(p, str):
            ids = await replica.encode_text(p, add_special_tokens=req.add_special_tokens)
        else:
            ids = list(p)
        prompts.append((ids, replica.check_prompt(ids, req.sampling.max_tokens)))
    env = Envelope(f"cmpl-{request_id(request)}", int(time.time()), replica.config.model)
    tracks = _submit(replica, prompts, req.sampling, "cmpl")
    if req.sampling.stream:
        return StreamingResponse(
            _stream_completion(replica, env, tracks, req.sampling),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    try:
        if not await _collect(request, tracks):
            return Response(status_code=CLIENT_CLOSED)
    except EngineCrashedError:
        raise ApiError(500, "The engine crashed while serving the request.") from None
    finally:
        _abort_all(replica, tracks)
    choices = [completion_choice(i, t.detok.text, t.finish_reason) for i, t in enumerate(tracks)]
    return JSONResponse(completion_response(env, choices, _total(tracks)))


async def _stream_completion(
    replica: Replica, env: Envelope, tracks: Sequence[_Track], s: Sampling
) -> AsyncIterator[bytes]:
    usage_field = s.include_usage or s.continuous_usage
    try:
        async for i, out in _merged(tracks):
            text = tracks[i].take(out)
            if not text and not out.finished:
                continue
            choice = completion_choice(i, text, tracks[i].finish_reason)
            usage = _total(tracks) if s.continuous_usage else None
            chunk = completion_chunk(env, [choice], usage)
            if not usage_field:
                del chunk["usage"]
            yield sse(chunk)
        if s.include_usage:
            yield sse(completion_chunk(env, [], _total(tracks)))
        yield DONE
    finally:
        _abort_all(replica, tracks)


async def chat_completions(replica: Replica, request: Request, body: object) -> Response:
    req = parse_chat(body)
    replica.check_model(req.model)
    ids = await replica.chat_prompt(req)
    max_tokens = replica.check_prompt(ids, req.sampling.max_tokens)
    env = Envelope(f"chatcmpl-{request_id(request)}", int(time.time()), replica.config.model)
    echo = ""
    if req.echo and req.messages[-1].get("role") == "assistant":
        echo = str(req.messages[-1].get("content") or "")
    tracks = _submit(replica, [(ids, max_tokens)], req.sampling, "chatcmpl")
    if req.sampling.stream:
        return StreamingResponse(
            _stream_chat(replica, env, tracks[0], req.sampling, echo),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    try:
        if not await _collect(request, tracks):
            return Response(status_code=CLIENT_CLOSED)
    except EngineCrashedError:
        raise ApiError(500, "The engine crashed while serving the request.") from None
    finally:
        _abort_all(replica, tracks)
    t = tracks[0]
    return JSONResponse(chat_response(env, echo + t.detok.text, t.finish_reason, t.usage))


async def _stream_chat(
    replica: Replica, env: Envelope, track: _Track, s: Sampling, echo: str
) -> AsyncIterator[bytes]:
    with_usage = s.include_usage or s.continuous_usage
    try:
        first = {"role": "assistant", "content": echo}
        yield sse(
            chat_delta_chunk(
                env, first, None, track.usage if s.continuous_usage else None, with_usage=with_usage
            )
        )
        async for _, out in _merged([track]):
            text = track.take(out)
            if not text and not out.finished:
                continue
            usage = track.usage if s.continuous_usage else None
            yield sse(
                chat_delta_chunk(env, {"content": text}, track.finish_reason, usage, with_usage=with_usage)
            )
        if s.include_usage:
            yield sse(chat_usage_chunk(env, track.usage))
        yield DONE
    finally:
        _abort_all(replica, [track])
