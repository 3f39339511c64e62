"""Every bad-input and limit case answers an OpenAI-style error with the right status."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from tests.serve_support import RouterThread, router_config, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "kvroute-sim"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    with RouterThread(router_config(sim=2, max_model_len=512, max_body_bytes=8192)) as r:
        yield r


def post(
    r: RouterThread, path: str, body: Any = None, *, content: bytes | None = None, **kw: Any
) -> httpx.Response:
    if content is None:
        return httpx.post(r.url + path, json=body, timeout=30, **kw)
    return httpx.post(r.url + path, content=content, timeout=30, **kw)


def assert_error(resp: httpx.Response, status: int, param: str | None = None, text: str = "") -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param
    assert text in err["message"]


def chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize(
    ("path", "content", "param"),
    [
        (CHAT, b"{not json", None),
        (CHAT, b"[1, 2]", None),
        (CHAT, b'{"model": "kvroute-sim"}', "messages"),
        (CHAT, b'{"messages": []}', "messages"),
        (CHAT, b'{"messages": [{"role": "user", "content": 5}]}', "messages"),
        (CHAT, b'{"messages": [{"content": "x"}]}', "messages"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": true}', "max_tokens"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stream_options": {}}', "stream_options"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}', "cache_salt"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "tools": [1]}', "tools"),
        (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "model": 3}', "model"),
        (COMPLETIONS, b'{"model": "kvroute-sim"}', "prompt"),
        (COMPLETIONS, b'{"prompt": ""}', "prompt"),
        (COMPLETIONS, b'{"prompt": []}', "prompt"),
        (COMPLETIONS, b'{"prompt": [1, -2]}', "prompt"),
        (COMPLETIONS, b'{"prompt": [[1], 7]}', "prompt"),
    ],
)
def test_malformed_requests_are_400(
    router: RouterThread, path: str, content: bytes, param: str | None
) -> None:
    assert_error(post(router, path, content=content), 400, param)


def test_unknown_model_is_404(router: RouterThread) -> None:
    assert_error(post(router, CHAT, {**chat(), "model": "gpt-9"}), 404, "model", "gpt-9")
    with (
        openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0) as c,
        pytest.raises(openai.NotFoundError),
    ):
        c.completions.create(model="nope", prompt="x")


def test_body_too_large_is_413(router: RouterThread) -> None:
    assert_error(post(router, CHAT, chat("x" * 9000)), 413)
    # Without a Content-Length (chunked upload), the limit holds as the body streams in.
    assert_error(post(router, CHAT, content=iter([b"{" + b" " * 5000, b" " * 5000 + b"}"])), 413)  # type: ignore[arg-type]


def test_prompt_longer_than_the_context_is_400(router: RouterThread) -> None:
    assert_error(post(router, CHAT, chat("word " * 600)), 400, "messages", "maximum context length is 512")
    assert_error(post(router, COMPLETIONS, {"prompt": list(range(512))}), 400, "prompt")
    assert_error(post(router, CHAT, chat("short", max_tokens=510)), 400, "max_tokens")
    assert post(router, CHAT, chat("short", max_tokens=8)).status_code == 200
    router.wait_idle()


def test_unknown_route_and_method(router: RouterThread) -> None:
    assert_error(httpx.get(router.url + "/v1/nothing"), 404)
    assert_error(httpx.get(router.url + CHAT), 405)


def test_non_text_parts_are_routed_on_best_information(router: RouterThread) -> None:
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = post(
        router, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    assert "kvroute_inexact_prompts_total 1.0" in httpx.get(router.url + "/metrics").text


def test_no_healthy_backend_is_503() -> None:
    with RouterThread(router_config(sim=2)) as r:
        for i in range(2):
            r.fault(i, "unavailable", 30)
        wait_until(lambda: not any(b["healthy"] for b in r.status()["backends"]))
        assert_error(post(r, CHAT, chat()), 503, text="no healthy backend")
        assert httpx.get(r.url + "/health").status_code == 503
        for i in range(2):
            r.fault(i, "clear")
        wait_until(lambda: all(b["healthy"] for b in r.status()["backends"]))
        assert post(r, CHAT, chat(max_tokens=2)).status_code == 200


def test_over_the_concurrency_limit_is_429_with_retry_after() -> None:
    with RouterThread(router_config(max_concurrency=2, max_queue=1, retry_after_s=3)) as r:
        fake = r.add_fake(delay_s=0.5)
        r.admin("POST", "/admin/backends", json={"url": fake.url, "events": "none"}).raise_for_status()

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=r.url, timeout=30) as c:
                return await asyncio.gather(*(c.post(CHAT, json=chat()) for _ in range(5)))

        codes = sorted(x.status_code for x in asyncio.run(burst()))
        assert codes == [200, 200, 200, 429, 429]
        rejected = [x for x in asyncio.run(burst()) if x.status_code == 429]
        assert rejected
        assert rejected[0].headers["retry-after"] == "3"
        assert_error(rejected[0], 429)
        r.wait_idle()


def test_every_engine_at_its_inflight_limit_is_429() -> None:
    with RouterThread(router_config(max_inflight_per_worker=1)) as r:
        fake = r.add_fake(delay_s=0.5)
        r.admin("POST", "/admin/backends", json={"url": fake.url, "events": "none"}).raise_for_status()

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=r.url, timeout=30) as c:
                return await asyncio.gather(*(c.post(CHAT, json=chat()) for _ in range(3)))

        out = asyncio.run(burst())
        assert sorted(x.status_code for x in out) == [200, 429, 429]
        assert "retry-after" in next(x for x in out if x.status_code == 429).headers
        r.wait_idle()


def test_api_keys_and_a_separate_admin_key() -> None:
    with RouterThread(router_config(sim=1, api_keys=("k1", "k2"))) as r:
        assert_error(post(r, CHAT, chat()), 401)
        assert_error(post(r, CHAT, chat(), headers={"authorization": "Bearer nope"}), 401)
        assert post(r, CHAT, chat(max_tokens=2), headers={"authorization": "Bearer k2"}).status_code == 200
        with openai.OpenAI(base_url=r.base_url, api_key="k1", max_retries=0) as c:
            assert c.models.list().data[0].id == MODEL
        with (
            openai.OpenAI(base_url=r.base_url, api_key="bad", max_retries=0) as c,
            pytest.raises(openai.AuthenticationError),
        ):
            c.models.list()
        # The client key does not open the admin API, and the admin key is not a client key.
        assert_error(httpx.get(r.url + "/admin/backends", headers={"authorization": "Bearer k1"}), 401)
        assert r.admin("GET", "/admin/backends").status_code == 200
        assert_error(post(r, CHAT, chat(), headers={"authorization": "Bearer admin-key"}), 401)
    with RouterThread(router_config(sim=1, admin_key=None)) as r:
        assert_error(httpx.get(r.url + "/admin/backends"), 403)
