"""The engine-side plugin ``kvroute.vllm``: store, rewrites, settings, middleware, receiver.

End-to-end runs through the router and the simulator are in ``test_serve_handoff.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from array import array
from typing import Any

import pytest
import zmq
import zmq.asyncio

from kvroute.vllm import HandoffSettings, TokenHandoffMiddleware, TokenReceiver, TokenStore, shared_receiver
from kvroute.vllm.rewrite import decode_ids, rewrite
from router_support import async_test


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def u32(ids: list[int]) -> bytes:
    return array("I", ids).tobytes()


# -- store ------------------------------------------------------------------------------------


@async_test(5)
async def test_store_single_use_and_ttl() -> None:
    clock = Clock()
    store = TokenStore(ttl_s=1.0, clock=clock)
    assert store.put(b"a", b"1234") == "stored"
    assert store.put(b"a", b"5678") == "duplicate"
    assert await store.take(b"a", 0) == b"1234"
    assert await store.take(b"a", 0) is None  # single use
    store.put(b"b", b"1234")
    clock.now += 1.5
    assert await store.take(b"b", 0) is None  # stale
    assert store.stats.stale == 1
    assert store.stats.used == 0
    assert store.stats.missing == 1
    store.put(b"c", b"1234")
    clock.now += 2
    store.put(b"d", b"1234")  # expires c on the way
    assert len(store) == 1
    assert store.size_bytes == 4
    assert store.stats.stale == 2


@async_test(5)
async def test_store_caps_refuse_new_entries() -> None:
    store = TokenStore(max_entries=2, max_bytes=10)
    assert store.put(b"a", b"1234") == "stored"
    assert store.put(b"b", b"1234") == "stored"
    assert store.put(b"c", b"12") == "full"  # entry cap
    assert await store.take(b"a", 0) == b"1234"
    assert store.put(b"c", b"12345678") == "full"  # byte cap (4 + 8 > 10)
    assert store.put(b"c", b"1234") == "stored"
    assert store.stats.rejected_full == 2


@async_test(5)
async def test_store_waits_for_a_key_then_counts_late_tokens() -> None:
    store = TokenStore()
    waiter = asyncio.create_task(store.take(b"k", 1.0))
    await asyncio.sleep(0.01)
    assert store.put(b"k", b"abcd") == "delivered"
    assert await waiter == b"abcd"
    assert await store.take(b"gone", 0.02) is None
    assert store.put(b"gone", b"abcd") == "late"
    assert len(store) == 0
    assert store.stats.missing == 1
    assert store.stats.late == 1
    assert store.stats.received == 1


# -- rewrites ---------------------------------------------------------------------------------


def test_decode_ids_checks_length_and_count() -> None:
    assert decode_ids(u32([1, 2, 70000]), 3) == [1, 2, 70000]
    assert decode_ids(u32([1, 2]), None) == [1, 2]
    assert decode_ids(u32([1, 2]), 3) is None  # the announced count differs
    assert decode_ids(b"\x01\x02\x03", None) is None  # not whole u32 words
    assert decode_ids(b"", None) is None


def test_chat_rewrite_appends_kv_transfer_params() -> None:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode() + b"\n"
    out = rewrite("chat", body, [5, 6])
    assert out is not None
    assert json.loads(out) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {"prompt_token_ids": [5, 6]},
    }
    # Existing kv_transfer_params (e.g. a P/D connector's) are kept.
    body = json.dumps({"messages": [], "kv_transfer_params": {"do_remote_prefill": True}}).encode()
    out = rewrite("chat", body, [5])
    assert out is not None
    assert json.loads(out)["kv_transfer_params"] == {"do_remote_prefill": True, "prompt_token_ids": [5]}


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi"}], "echo": True},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": {"prompt_token_ids": [1]}},
        {"messages": [{"role": "user", "content": "hi"}], "kv_transfer_params": "x"},
        [1, 2],
    ],
)
def test_chat_rewrite_leaves_what_vllm_would_not_use(body: object) -> None:
    assert rewrite("chat", json.dumps(body).encode(), [1]) is None


def test_completion_rewrite() -> None:
    out = rewrite("completion", json.dumps({"model": "m", "prompt": "héllo", "max_tokens": 2}).encode(), [9])
    assert out is not None
    assert json.loads(out) == {"model": "m", "prompt": [9], "max_tokens": 2}
    for prompt in (["a", "b"], [1, 2]):
        assert rewrite("completion", json.dumps({"prompt": prompt}).encode(), [9]) is None
    assert rewrite("completion", json.dumps({"prompt": "a", "echo": True}).encode(), [9]) is None
    assert rewrite("completion", b"{not json", [9]) is None


# -- settings ---------------------------------------------------------------------------------


def test_settings_from_env() -> None:
    s = HandoffSettings.from_env(
        {"KVROUTE_HANDOFF_BIND": "tcp://127.0.0.1:5999", "KVROUTE_HANDOFF_WAIT_S": "0.2", "X": "y"}
    )
    assert s.bind == "tcp://127.0.0.1:5999"
    assert s.wait_s == 0.2
    assert s.enabled
    assert not HandoffSettings.from_env({"KVROUTE_HANDOFF": "0"}).enabled
    with pytest.raises(ValueError, match="KVROUTE_HANDOFF_TTL_S"):
        HandoffSettings.from_env({"KVROUTE_HANDOFF_TTL_S": "soon"})
    with pytest.raises(ValueError, match="KVROUTE_HANDOFF_BIND"):
        HandoffSettings(bind="127.0.0.1:5")


def test_import_is_light() -> None:
    """vLLM imports the module in its API server: no ZMQ, HTTP framework or tokenizer at import."""
    code = (
        "import sys, kvroute.vllm; "
        "heavy = [m for m in ('zmq', 'starlette', 'fastapi', 'jinja2', 'tokenizers', 'numpy', "
        "'aiohttp', 'httpx', 'uvicorn', 'fastokens') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_shared_receiver_is_one_per_settings() -> None:
    s = HandoffSettings(bind="tcp://127.0.0.1:*", ttl_s=1.25)
    a = TokenHandoffMiddleware(_echo_app, settings=s)
    b = TokenHandoffMiddleware(_echo_app, settings=s)
    assert a.receiver is b.receiver is shared_receiver(s)
    assert TokenHandoffMiddleware(_echo_app, settings=HandoffSettings(enabled=False)).receiver is None


# -- middleware over a recording app ---------------------------------------------------------


async def _echo_app(scope: Any, receive: Any, send: Any) -> None:
    """Answers with the body it received and its content-length header."""
    chunks = []
    while True:
        m = await receive()
        chunks.append(m.get("body", b""))
        if not m.get("more_body"):
            break
    length = dict(scope["headers"]).get(b"content-length", b"")
    await send({"type": "http.response.start", "status": 200, "headers": [(b"x-length", length)]})
    await send({"type": "http.response.body", "body": b"".join(chunks)})


async def call(
    mw: TokenHandoffMiddleware,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[bytes, bytes], bytes]:
    hdrs = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": hdrs}
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    out: dict[str, Any] = {"body": b""}

    async def send(m: dict[str, Any]) -> None:
        if m["type"] == "http.response.start":
            out["status"], out["headers"] = m["status"], dict(m["headers"])
        else:
            out["body"] += m.get("body", b"")

    await mw(scope, receive, send)
    return out["status"], out["headers"], out["body"]


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()


@async_test(10)
async def test_middleware_uses_handed_off_tokens_and_falls_back() -> None:
    receiver = TokenReceiver(HandoffSettings(bind="tcp://127.0.0.1:*", wait_s=0.05))
    mw = TokenHandoffMiddleware(_echo_app, receiver=receiver)
    try:
        status, _, raw = await call(mw, "GET", "/kvroute/handoff")
        info = json.loads(raw)
        assert status == 200
        assert info["endpoint"].startswith("tcp://127.0.0.1:")
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.connect(info["endpoint"])
        await push.send_multipart([b"k1", u32([7, 8, 9])])
        await push.send_multipart([b"k2", u32([7, 8])])
        await push.send_multipart([b"only-one-frame"])
        for _ in range(100):
            if len(receiver.store) == 2 and receiver.malformed_frames == 1:
                break
            await asyncio.sleep(0.01)
        used = {"x-kvroute-token-key": "k1", "x-kvroute-token-count": "3"}
        status, headers, body = await call(mw, "POST", "/v1/chat/completions", CHAT, used)
        assert headers[b"x-kvroute-handoff"] == b"used"
        assert json.loads(body)["kv_transfer_params"] == {"prompt_token_ids": [7, 8, 9]}
        assert headers[b"x-length"] == str(len(body)).encode()
        # Wrong length for the announced count, an unknown key, no key at all, a GET.
        wrong = {"x-kvroute-token-key": "k2", "x-kvroute-token-count": "3"}
        _, headers, body = await call(mw, "POST", "/v1/chat/completions", CHAT, wrong)
        assert headers[b"x-kvroute-handoff"] == b"malformed"
        assert body == CHAT
        missing = {"x-kvroute-token-key": "nope"}
        _, headers, body = await call(mw, "POST", "/v1/completions", CHAT, missing)
        assert headers[b"x-kvroute-handoff"] == b"missing"
        assert body == CHAT
        _, headers, body = await call(mw, "POST", "/v1/chat/completions", CHAT)
        assert b"x-kvroute-handoff" not in headers
        assert body == CHAT
        stats = receiver.store.stats
        assert (stats.used, stats.malformed, stats.missing) == (1, 1, 1)
        push.close(0)
        ctx.term()
    finally:
        await receiver.aclose()


@async_test(10)
async def test_middleware_passes_large_bodies_and_bind_failures_through() -> None:
    receiver = TokenReceiver(HandoffSettings(bind="tcp://127.0.0.1:*", max_body_bytes=64))
    mw = TokenHandoffMiddleware(_echo_app, receiver=receiver)
    try:
        big = json.dumps({"prompt": "x" * 100}).encode()
        receiver.store.put(b"k", u32([1]))
        _, headers, body = await call(mw, "POST", "/v1/completions", big, {"x-kvroute-token-key": "k"})
        assert headers[b"x-kvroute-handoff"] == b"too_large"
        assert body == big
        # A second receiver on the same port cannot bind: it stays off and says why.
        assert receiver.endpoint is not None
        clash = TokenReceiver(HandoffSettings(bind=receiver.endpoint))
        mw2 = TokenHandoffMiddleware(_echo_app, receiver=clash)
        status, _, raw = await call(mw2, "GET", "/kvroute/handoff")
        assert status == 503
        assert "cannot bind" in json.loads(raw)["error"]
        _, headers, body = await call(mw2, "POST", "/v1/chat/completions", CHAT, {"x-kvroute-token-key": "k"})
        assert headers[b"x-kvroute-handoff"] == b"off"
        assert body == CHAT
        await clash.aclose()
    finally:
        await receiver.aclose()
