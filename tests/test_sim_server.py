"""The simulator's HTTP surface through the real ``openai`` client (sync and async)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import openai
import pytest

from sim_support import ClusterThread, metric, shared_tokenizer, sim_config

MODEL = "sim-model"
# ~300 tokens: long enough for many full blocks.
LONG_PROMPT = " ".join(f"word{i} is followed by word{i + 1}." for i in range(60))


@pytest.fixture(scope="module")
def sim() -> Iterator[ClusterThread]:
    with ClusterThread(sim_config(max_body_bytes=64 * 1024)) as c:
        yield c


@pytest.fixture
def client(sim: ClusterThread) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=sim.urls[0] + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def aclient(sim: ClusterThread) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=sim.urls[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "vllm"


def test_completion_text_and_usage(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    assert choice.text
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(shared_tokenizer().encode(prompt))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    details = r.usage.prompt_tokens_details
    assert details is not None
    assert details.cached_tokens == 0


def test_repeated_prompt_hits_the_prefix_cache(client: openai.OpenAI, sim: ClusterThread) -> None:
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    assert first.usage is not None
    assert second.usage is not None
    n = second.usage.prompt_tokens
    assert n > 64
    assert second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    block = sim.cluster.replicas[0].block_size
    # Every full block but the one holding the last prompt token is reused (vLLM recomputes it).
    assert cached is not None
    assert cached % block == 0
    assert n - block <= cached < n
    assert metric(sim.urls[0], "vllm:prefix_cache_hits_total") >= cached


def test_token_id_prompts_skip_tokenization(client: openai.OpenAI, sim: ClusterThread) -> None:
    before = metric(sim.urls[0], "kvroute_sim:tokenized_requests_total")
    r = client.completions.create(model=MODEL, prompt=list(range(1000, 1040)), max_tokens=3)
    assert r.usage is not None
    assert r.usage.prompt_tokens == 40
    assert metric(sim.urls[0], "kvroute_sim:tokenized_requests_total") == before
    client.completions.create(model=MODEL, prompt="tokenize me", max_tokens=1)
    assert metric(sim.urls[0], "kvroute_sim:tokenized_requests_total") == before + 1


def test_batch_of_prompts(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["first prompt", "second one"], max_tokens=4)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage is not None
    assert r.usage.completion_tokens == 8


def test_streamed_completion_async(sim: ClusterThread) -> None:
    async def body() -> None:
        async with aclient(sim) as c:
            stream = await c.completions.create(
                model=MODEL,
                prompt=LONG_PROMPT,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        text_chunks = [ch for ch in chunks if ch.choices]
        assert len(text_chunks) > 1
        assert text_chunks[-1].choices[0].finish_reason == "length"
        assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])
        assert "".join(ch.choices[0].text for ch in text_chunks)
        usage = chunks[-1].usage
        assert not chunks[-1].choices
        assert usage is not None
        assert usage.completion_tokens == 12
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens is not None

    asyncio.run(asyncio.wait_for(body(), 30))


def test_chat_completion_sync(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        max_tokens=6,
    )
    assert r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 6


def test_chat_with_tools_renders_them(client: openai.OpenAI, sim: ClusterThread) -> None:
    msgs: list[dict[str, object]] = [{"role": "user", "content": "weather?"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)  # type: ignore[arg-type]
    with_tools = client.chat.completions.create(
        model=MODEL,
        messages=msgs,  # type: ignore[arg-type]
        tools=tools,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert plain.usage is not None
    assert with_tools.usage is not None
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens


def test_streamed_chat_async(sim: ClusterThread) -> None:
    async def body() -> None:
        async with aclient(sim) as c:
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a story."}],
                max_tokens=10,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert content
        finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert [ch.choices[0].finish_reason for ch in finals] == ["length"]
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 10

    asyncio.run(asyncio.wait_for(body(), 30))


def test_kv_transfer_prompt_token_ids_skip_templating(client: openai.OpenAI, sim: ClusterThread) -> None:
    url = sim.urls[0]
    messages = [{"role": "user", "content": "Summarise the plot of Hamlet."}]
    ids = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=10).json()["tokens"]
    tokenized = metric(url, "kvroute_sim:tokenized_requests_total")
    reused = metric(url, "kvroute_sim:reused_prompt_token_ids_requests_total")
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"kv_transfer_params": {"prompt_token_ids": ids}},
    )
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(ids)
    assert metric(url, "kvroute_sim:tokenized_requests_total") == tokenized
    assert metric(url, "kvroute_sim:reused_prompt_token_ids_requests_total") == reused + 1
    # With echo the ids are ignored, as vLLM does: the server templates and tokenizes.
    client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"kv_transfer_params": {"prompt_token_ids": ids}, "echo": True},
    )
    assert metric(url, "kvroute_sim:tokenized_requests_total") == tokenized + 1
    # Malformed ids are a 400.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=2,
            extra_body={"kv_transfer_params": {"prompt_token_ids": "nope"}},
        )


def test_request_id_is_honoured_and_echoed(sim: ClusterThread) -> None:
    r = httpx.post(
        f"{sim.urls[0]}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        headers={"X-Request-Id": "my-id-42"},
        timeout=10,
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "my-id-42"
    assert r.json()["id"] == "cmpl-my-id-42"
    assert httpx.get(f"{sim.urls[0]}/health", timeout=10).headers["x-request-id"]


def error_of(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert isinstance(err["message"], str)
    assert err["message"]
    error: dict[str, object] = err
    return error


def test_error_bodies(sim: ClusterThread) -> None:
    url = f"{sim.urls[0]}/v1/completions"
    post = httpx.Client(timeout=10)
    with post:
        assert error_of(post.post(url, content=b"{not json"), 400)["type"] == "BadRequestError"
        err = error_of(post.post(url, json={"model": "nope", "prompt": "x"}), 404)
        assert (err["type"], err["param"]) == ("NotFoundError", "model")
        assert "maximum context length" in str(
            error_of(post.post(url, json={"prompt": list(range(5000)), "max_tokens": 1}), 400)["message"]
        )
        error_of(post.post(url, json={"prompt": list(range(4090)), "max_tokens": 10}), 400)
        error_of(post.post(url, json={"prompt": "x", "n": 2}), 400)
        error_of(post.post(url, json={"prompt": "x", "max_tokens": "many"}), 400)  # never a 422
        error_of(post.post(url, json={"prompt": [999999999]}), 400)
        error_of(post.post(url, content=b"x" * (65 * 1024)), 413)
        error_of(post.post(f"{sim.urls[0]}/v1/chat/completions", json={"messages": "hi"}), 400)
        error_of(post.get(f"{sim.urls[0]}/v1/nothing"), 404)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", n=2)


def test_tokenize_and_detokenize(sim: ClusterThread) -> None:
    url = sim.urls[0]
    tok = shared_tokenizer()
    r = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert r == {
        "count": len(tok.encode("Hello world")),
        "max_model_len": 4096,
        "tokens": tok.encode("Hello world"),
        "token_strs": None,
    }
    msgs = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=10).json()
    assert r["tokens"][0] == 0
    assert r["tokens"][-1] == tok.token_id("<｜Assistant｜>")
    assert httpx.post(f"{url}/detokenize", json={"tokens": tok.encode("Hello world")}, timeout=10).json() == {
        "prompt": "Hello world"
    }
    error_of(httpx.post(f"{url}/tokenize", json={"nothing": 1}, timeout=10), 400)
    error_of(httpx.post(f"{url}/detokenize", json={"tokens": [-1]}, timeout=10), 400)


def test_metrics_have_vllm_names(client: openai.OpenAI, sim: ClusterThread) -> None:
    client.completions.create(model=MODEL, prompt="count me", max_tokens=1)
    text = httpx.get(f"{sim.urls[0]}/metrics", timeout=10).text
    for name in (
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "vllm:cache_config_info{",
        "vllm:request_success_total{",
        "vllm:time_to_first_token_seconds_bucket{",
        "kvroute_sim:tokenized_requests_total{",
    ):
        assert name in text, name
    info = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'block_size="16"' in info
    assert 'prefix_caching_hash_algo="sha256"' in info
    assert 'num_gpu_blocks="' in info
    assert metric(sim.urls[0], "vllm:request_success_total", finished_reason="length") >= 1
    assert metric(sim.urls[0], "vllm:time_to_first_token_seconds_count") >= 1
    assert httpx.get(f"{sim.urls[0]}/health", timeout=10).status_code == 200
