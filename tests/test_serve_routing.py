"""Routing end to end: conversations stick to the engine holding their prefix (learned from the
engines' KV events alone), and a shared system prompt does not pile every request onto one engine."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from tests.serve_support import RouterThread, router_config, wait_until

pytestmark = pytest.mark.timeout(120)

MODEL = "kvroute-sim"
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
]


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    # No speculation: affinity must come from the engines' own KV events.
    with RouterThread(router_config(sim=4, speculative_ttl_s=0.0)) as r:
        wait_until(lambda: all(b["engines"][0]["events"]["connected"] for b in r.status()["backends"]))
        yield r


def send(r: RouterThread, messages: list[dict[str, str]], max_tokens: int = 4) -> tuple[str, str]:
    resp = httpx.post(
        r.base_url + "/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": max_tokens},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    return resp.headers["x-kvroute-backend"], resp.json()["choices"][0]["message"]["content"]


def test_second_turn_lands_on_the_engine_holding_the_first(router: RouterThread) -> None:
    rng = random.Random(3)
    for conv in range(8):
        history = [
            {"role": "system", "content": f"conversation {conv}: " + text(rng, 400)},
            {"role": "user", "content": text(rng, 50)},
        ]
        first, reply = send(router, history)
        # Wait until the engine's KV events for turn 1 have reached the index.
        tokens = router.prompt_tokens(history)
        wait_until(lambda: router.cached_blocks(first, tokens) >= len(tokens) // 64)  # noqa: B023
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": text(rng, 30)}]
        second, _ = send(router, history)
        assert second == first, f"conversation {conv}: turn 1 on {first}, turn 2 on {second}"
    assert router.status()["scheduler"]["counters"]["decisions"] >= 16
    router.wait_idle()


def test_shared_system_prompt_spreads_under_load() -> None:
    rng = random.Random(5)
    system = "You are the shared assistant. " + text(rng, 1500)
    with RouterThread(router_config(sim=4, sim_time_scale=5.0)) as r:

        async def burst() -> list[str]:
            async with httpx.AsyncClient(base_url=r.base_url, timeout=60) as c:

                async def one(i: int) -> str:
                    messages = [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"{i} " + text(rng, 300)},
                    ]
                    resp = await c.post(
                        "/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 16}
                    )
                    assert resp.status_code == 200, resp.text
                    return resp.headers["x-kvroute-backend"]

                return await asyncio.gather(*(one(i) for i in range(32)))

        counts = Counter(asyncio.run(asyncio.wait_for(burst(), 90)))
        assert len(counts) >= 3, counts
        assert max(counts.values()) <= 24, counts
        r.wait_idle()
