"""Request rewrites that make vLLM 0.33 prefill handed-off token ids instead of tokenizing.

* ``POST /v1/completions``: a string ``prompt`` becomes the list of token ids (vLLM then skips the
  tokenizer; ``add_special_tokens`` no longer applies, and the router's ids already include what it
  added).
* ``POST /v1/chat/completions``: ``kv_transfer_params.prompt_token_ids`` is set, which makes vLLM's
  renderer skip the chat template and the tokenizer (``renderers/online_renderer.py``). vLLM ignores
  it with ``echo`` or non-text content parts, so such requests are not rewritten.

Anything unexpected (not JSON, several prompts, ids the client already gave, ``echo``) leaves the
body untouched: the functions return None and the engine tokenizes as usual. Only ``json`` and
``array`` are imported: this module loads inside vLLM's API server.
"""

from __future__ import annotations

import json
import sys
from array import array
from typing import Any, Literal

Kind = Literal["chat", "completion"]
ROUTES: dict[str, Kind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


def decode_ids(payload: bytes, count: int | None) -> list[int] | None:
    """Token ids from little-endian u32 bytes; None if the length is not a whole, non-zero number
    of ids or differs from ``count`` (the router's announced token count)."""
    if not payload or len(payload) % 4:
        return None
    if count is not None and len(payload) // 4 != count:
        return None
    ids = array("I")
    ids.frombytes(payload)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def _non_text(messages: object) -> bool:
    if not isinstance(messages, list):
        return True
    for m in messages:
        if not isinstance(m, dict):
            return True
        content = m.get("content")
        if isinstance(content, list) and any(
            not isinstance(p, dict) or p.get("type") != "text" for p in content
        ):
            return True
    return False


def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def _ids_json(ids: list[int]) -> bytes:
    return json.dumps(ids, separators=(",", ":")).encode()


def rewrite_chat(body: bytes, ids: list[int]) -> bytes | None:
    try:
        obj: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or obj.get("echo") or _non_text(obj.get("messages")):
        return None
    if "kv_transfer_params" not in obj:
        # Append the field instead of re-encoding the whole body: the messages of a long prompt
        # are most of it. The body is a JSON object (just parsed), so it ends with '}'.
        head = body.rstrip()[:-1].rstrip()
        sep = b"" if head.endswith(b"{") else b","
        return head + sep + b'"kv_transfer_params":{"prompt_token_ids":' + _ids_json(ids) + b"}}"
    kv = obj["kv_transfer_params"]
    if kv is None:
        kv = {}
    if not isinstance(kv, dict) or kv.get("prompt_token_ids") is not None:
        return None
    obj["kv_transfer_params"] = {**kv, "prompt_token_ids": ids}
    return _dump(obj)


def rewrite_completion(body: bytes, ids: list[int]) -> bytes | None:
    try:
        obj: Any = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or obj.get("echo"):
        return None
    obj["prompt"] = ids
    return _dump(obj)


def rewrite(kind: Kind, body: bytes, ids: list[int]) -> bytes | None:
    """The body with ``ids`` as its prompt, or None when it should go to vLLM untouched."""
    return rewrite_chat(body, ids) if kind == "chat" else rewrite_completion(body, ids)
