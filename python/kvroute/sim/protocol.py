"""OpenAI/vLLM request bodies -> validated, typed requests; errors -> OpenAI error bodies.

Validation problems are 400s with vLLM's body ``{"error": {"message", "type", "param", "code"}}``
(never 422). Fields the simulator has no use for (``temperature``, ``top_p``, ``seed``, ``user``...)
are accepted and ignored, as vLLM ignores unknown fields. What it cannot honour faithfully is
rejected: ``n`` > 1, ``best_of`` > 1, ``echo`` on completions, ``continue_final_message``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.chat_template import ChatTemplateError, has_non_text_parts, normalize_messages

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "BadRequestError"),
                "param": self.param,
                "code": self.status,
            }
        }


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


@dataclass(frozen=True, slots=True)
class Sampling:
    """What the engine gets besides the prompt."""

    max_tokens: int | None
    """None: the rest of the context (chat) -- the server applies its cap."""
    ignore_eos: bool
    cache_salt: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...]
    add_special_tokens: bool
    sampling: Sampling


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str | None
    messages: tuple[dict[str, Any], ...]
    tools: tuple[dict[str, Any], ...] | None
    add_generation_prompt: bool
    add_special_tokens: bool
    echo: bool
    reused_prompt_token_ids: tuple[int, ...] | None
    """``kv_transfer_params.prompt_token_ids`` when vLLM would use them (not with echo or
    non-text parts): templating and tokenization are skipped."""
    sampling: Sampling


def _get(body: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int subclass; an int field must not take true/false.
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise bad_request(f"'{key}' has the wrong type", key)
    if not isinstance(value, kind):
        raise bad_request(f"'{key}' has the wrong type", key)
    return value


def _token_ids(value: object, param: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"'{param}' must be a list of token ids", param)
    if any(t < 0 for t in value):
        raise bad_request(f"'{param}' has a negative token id", param)
    return tuple(value)


def _sampling(body: Mapping[str, Any], default_max_tokens: int | None) -> Sampling:
    n = _get(body, "n", int, 1)
    if n != 1:
        raise bad_request("only n=1 is supported by the kvroute simulator", "n")
    best_of = _get(body, "best_of", int, 1)
    if best_of != 1:
        raise bad_request("only best_of=1 is supported by the kvroute simulator", "best_of")
    max_tokens = _get(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, default_max_tokens)
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    stream = _get(body, "stream", bool, False)
    options = _get(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise bad_request("Stream options can only be defined when `stream=True`.", "stream_options")
    options = options or {}
    salt = _get(body, "cache_salt", str, None)
    if salt is not None and not salt:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return Sampling(
        max_tokens=max_tokens,
        ignore_eos=_get(body, "ignore_eos", bool, False),
        cache_salt=salt,
        stream=stream,
        include_usage=_get(options, "include_usage", bool, False),
        continuous_usage=_get(options, "continuous_usage_stats", bool, False),
    )


def parse_completion(body: object) -> CompletionRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if _get(body, "echo", bool, False):
        raise bad_request("echo=true is not supported by the kvroute simulator", "echo")
    if _get(body, "suffix", str, None):
        raise bad_request("suffix is not supported", "suffix")
    raw = body.get("prompt")
    prompts: list[str | tuple[int, ...]]
    if isinstance(raw, str):
        prompts = [raw]
    elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        prompts = [_token_ids(raw, "prompt")]
    elif isinstance(raw, list) and raw:
        prompts = []
        for p in raw:
            if isinstance(p, str):
                prompts.append(p)
            else:
                prompts.append(_token_ids(p, "prompt"))
    else:
        raise bad_request(
            "'prompt' must be a string, a list of token ids, or a non-empty list of those", "prompt"
        )
    if any(len(p) == 0 for p in prompts):
        raise bad_request("prompt cannot be empty", "prompt")
    return CompletionRequest(
        model=_get(body, "model", str, None),
        prompts=tuple(prompts),
        add_special_tokens=_get(body, "add_special_tokens", bool, True),
        sampling=_sampling(body, 16),  # vLLM's CompletionRequest default
    )


def parse_chat(body: object) -> ChatRequest:
    """``POST /v1/chat/completions``."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    raw_messages = body.get("messages")
    try:
        messages = normalize_messages(raw_messages)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    assert isinstance(raw_messages, list)
    tools = _get(body, "tools", list, None)
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise bad_request("'tools' must be a list of objects", "tools")
    if _get(body, "continue_final_message", bool, False):
        raise bad_request("continue_final_message is not supported by the kvroute simulator")
    echo = _get(body, "echo", bool, False)
    reused: tuple[int, ...] | None = None
    kv = _get(body, "kv_transfer_params", dict, None)
    if kv is not None and kv.get("prompt_token_ids") is not None:
        ids = _token_ids(kv["prompt_token_ids"], "kv_transfer_params.prompt_token_ids")
        if not ids:
            raise bad_request("kv_transfer_params.prompt_token_ids is empty", "kv_transfer_params")
        if not echo and not has_non_text_parts(raw_messages):
            reused = ids
    return ChatRequest(
        model=_get(body, "model", str, None),
        messages=tuple(messages),
        tools=tuple(tools) if tools else None,
        add_generation_prompt=_get(body, "add_generation_prompt", bool, True),
        add_special_tokens=_get(body, "add_special_tokens", bool, False),
        echo=echo,
        reused_prompt_token_ids=reused,
        sampling=_sampling(body, None),
    )
