"""What the router needs from a client's request body, validated (400 on a malformed one).

The router checks only what it must understand to route (the prompt, ``model``, ``stream``,
``max_tokens``, ``cache_salt``) and what would otherwise fail on every backend in the same way;
everything else is the backend's business, and the body is forwarded byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvroute.chat_template import ChatTemplateError, has_non_text_parts, normalize_messages
from kvroute.server.errors import bad_request


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: Literal["chat", "completion"]
    model: str | None
    stream: bool
    max_tokens: int | None
    salt: str | None
    messages: list[dict[str, Any]] | None = None
    """Chat: the messages as given (rendering normalises them again)."""
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    non_text: bool = False
    """Chat: some content part is not text (image, audio...): the prompt is approximate."""
    reused_ids: list[int] | None = None
    """Chat: ``kv_transfer_params.prompt_token_ids`` that vLLM will prefill instead of rendering."""
    prompt_text: str | None = None
    """Completion: the (first) text prompt."""
    prompt_ids: list[int] | None = None
    """Completion: the (first) token-id prompt."""
    prompts: int = 1


def _get(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise bad_request(f"'{key}' must be of type {names}", key)
    return value


def _token_ids(value: object, param: str) -> list[int]:
    if not isinstance(value, list) or not all(type(t) is int and t >= 0 for t in value):
        raise bad_request(f"'{param}' must be a list of non-negative token ids", param)
    return value


def decode_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    model = _get(body, "model", str)
    stream = _get(body, "stream", bool, False)
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    salt = _get(body, "cache_salt", str)
    if salt is not None and not salt:
        raise bad_request("'cache_salt' must be a non-empty string if provided", "cache_salt")
    if _get(body, "stream_options", dict) is not None and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    return {"model": model, "stream": stream, "max_tokens": max_tokens, "salt": salt}


def parse_chat(body: Mapping[str, Any]) -> ParsedRequest:
    """``POST /v1/chat/completions``."""
    messages = body.get("messages")
    try:
        normalize_messages(messages)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    assert isinstance(messages, list)
    tools = _get(body, "tools", list)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise bad_request("'tools' must be a list of objects", "tools")
    non_text = has_non_text_parts(messages)
    reused = None
    kv = _get(body, "kv_transfer_params", dict)
    if kv is not None and kv.get("prompt_token_ids") is not None:
        ids = _token_ids(kv["prompt_token_ids"], "kv_transfer_params.prompt_token_ids")
        if not ids:
            raise bad_request("kv_transfer_params.prompt_token_ids is empty", "kv_transfer_params")
        if not _get(body, "echo", bool, False) and not non_text:
            reused = ids
    return ParsedRequest(
        kind="chat",
        messages=messages,
        tools=tools or None,
        add_generation_prompt=_get(body, "add_generation_prompt", bool, True),
        add_special_tokens=_get(body, "add_special_tokens", bool, False),
        non_text=non_text,
        reused_ids=reused,
        **_common(body),
    )


def parse_completion(body: Mapping[str, Any]) -> ParsedRequest:
    """``POST /v1/completions``: a string, a token-id list, or a non-empty list of either."""
    raw = body.get("prompt")
    first: object
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(type(t) is int for t in raw)):
        first, count = raw, 1
    elif isinstance(raw, list) and raw and all(isinstance(p, str | list) for p in raw):
        first, count = raw[0], len(raw)
        for p in raw:
            if isinstance(p, list):
                _token_ids(p, "prompt")
    else:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a non-empty list of those", "prompt"
        )
    if isinstance(first, list):
        ids = _token_ids(first, "prompt")
        if not ids:
            raise bad_request("the prompt cannot be empty", "prompt")
        return ParsedRequest(kind="completion", prompt_ids=ids, prompts=count, **_common(body))
    assert isinstance(first, str)
    if not first:
        raise bad_request("the prompt cannot be empty", "prompt")
    return ParsedRequest(
        kind="completion",
        prompt_text=first,
        add_special_tokens=_get(body, "add_special_tokens", bool, True),
        prompts=count,
        **_common(body),
    )
