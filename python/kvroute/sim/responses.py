"""Response bodies and SSE chunks in the shapes vLLM 0.33's OpenAI server produces.

Streams are ``text/event-stream``: one ``data: {json}\\n\\n`` event per chunk and a final
``data: [DONE]\\n\\n``. With ``stream_options.include_usage`` every chunk carries ``"usage": null``
and one last chunk has empty ``choices`` and the usage; with ``continuous_usage_stats`` every
chunk carries the usage so far.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every chunk and response of one request shares."""

    id: str
    created: int
    model: str


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }


def completion_chunk(env: Envelope, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": env.id,
        "object": "text_completion",
        "created": env.created,
        "model": env.model,
        "choices": choices,
    }
    chunk["usage"] = usage.body() if usage is not None else None
    return chunk


def completion_response(env: Envelope, choices: list[dict[str, Any]], usage: Usage) -> dict[str, Any]:
    for c in choices:
        c["prompt_logprobs"] = None
    return {
        "id": env.id,
        "object": "text_completion",
        "created": env.created,
        "model": env.model,
        "choices": choices,
        "usage": usage.body(),
        "kv_transfer_params": None,
    }


def chat_delta_chunk(
    env: Envelope, delta: dict[str, Any], finish_reason: str | None, usage: Usage | None, *, with_usage: bool
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": env.id,
        "object": "chat.completion.chunk",
        "created": env.created,
        "model": env.model,
        "choices": [
            {
                "index": 0,
                "delta": delta,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
    }
    if with_usage:
        chunk["usage"] = usage.body() if usage is not None else None
    return chunk


def chat_usage_chunk(env: Envelope, usage: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "object": "chat.completion.chunk",
        "created": env.created,
        "model": env.model,
        "choices": [],
        "usage": usage.body(),
    }


def chat_response(env: Envelope, content: str, finish_reason: str | None, usage: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "object": "chat.completion",
        "created": env.created,
        "model": env.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None, "tool_calls": []},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": usage.body(),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def models_response(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [],
            }
        ],
    }
