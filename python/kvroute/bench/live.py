"""``kvroute bench live``: an open-loop load generator for any OpenAI-compatible endpoint.

Requests are sent at the workload's arrival times (a Mooncake trace or a built-in generator, after
its arrival process), divided by ``speedup``, whether or not earlier ones have finished (open
loop), and streamed. Per request it records the time to the first streamed text (TTFT), the gaps
between later text chunks (inter-token latency; a chunk may carry several tokens) and the time to
the end of the stream (end to end).

Prompts are text: each block id of the workload becomes the same ``block_tokens`` words every time
(drawn from a fixed 1,024-word vocabulary seeded by the id), so requests that share leading ids
share leading text, as the trace encodes. A word is about one token for common tokenizers.
The run is bounded: at most ``requests`` requests, none started after ``duration_s``, each cut at
``timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvroute import _native

ProgressFn = Callable[[str, int, int], None]

_MASK = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


_SYLLABLES = ("ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "va", "ze", "bo", "di", "fu", "ge", "hi", "jo")
#: 1,024 pronounceable words (two to three syllables), fixed forever.
VOCAB = tuple(
    _SYLLABLES[i % 16] + _SYLLABLES[(i // 16) % 16] + ("" if i < 256 else _SYLLABLES[i // 256 + 3])
    for i in range(1024)
)


def prompt_text(ids: list[int], input_length: int, block_tokens: int, seed: int = 0) -> str:
    """``input_length`` words; block ``id`` always yields the same ``block_tokens`` words."""
    words: list[str] = []
    for block in ids:
        if len(words) >= input_length:
            break
        s = _mix(seed ^ (block * 0x9E3779B97F4A7C15 & _MASK))
        for _ in range(min(block_tokens, input_length - len(words))):
            s = _mix(s)
            words.append(VOCAB[s & 1023])
    return " ".join(words)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (NumPy's default); 0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    pos = q / 100.0 * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass(frozen=True)
class LiveSettings:
    url: str
    source: str
    model: str = "default"
    requests: int | None = 200
    speedup: float = 1.0
    arrival: str = "trace"
    arrival_rate: float | None = None
    arrival_trace: str | None = None
    max_tokens: int | None = None
    max_prompt_tokens: int | None = None
    chat: bool = False
    ignore_eos: bool = True
    api_key: str | None = None
    duration_s: float = 600.0
    timeout_s: float = 120.0
    label: str = "live"
    seed: int = 0


@dataclass
class Sample:
    arrival_s: float
    prompt_words: int
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    chunks: int = 0
    itl_ms: tuple[float, ...] = ()
    error: str | None = None


def _body(s: LiveSettings, text: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": s.model, "max_tokens": max_tokens, "stream": True}
    if s.chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if s.ignore_eos:
        body["ignore_eos"] = True
    return body


def _chunk_text(data: dict[str, Any]) -> str:
    out = []
    for c in data.get("choices") or []:
        out.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(out)


async def _one(client: Any, s: LiveSettings, sample: Sample, body: dict[str, Any]) -> None:
    path = "/v1/chat/completions" if s.chat else "/v1/completions"
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    start = time.perf_counter()
    last = None
    gaps: list[float] = []
    try:
        async with client.stream("POST", s.url.rstrip("/") + path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                await resp.aread()
                sample.error = f"HTTP {resp.status_code}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                if not _chunk_text(json.loads(payload)):
                    continue
                now = time.perf_counter()
                if last is None:
                    sample.ttft_ms = (now - start) * 1000.0
                else:
                    gaps.append((now - last) * 1000.0)
                last = now
                sample.chunks += 1
        sample.e2e_ms = (time.perf_counter() - start) * 1000.0
        sample.itl_ms = tuple(gaps)
        if sample.ttft_ms is None:
            sample.error = "no text streamed"
    except Exception as e:  # noqa: BLE001 - any failure of one request is recorded, not raised
        sample.error = f"{type(e).__name__}: {e}"


async def run_async(s: LiveSettings, progress: ProgressFn | None = None) -> dict[str, Any]:
    import httpx

    block_tokens, records = _native.load_workload(
        s.source,
        requests=s.requests,
        arrival=s.arrival,
        arrival_rate=s.arrival_rate,
        arrival_trace=s.arrival_trace,
        seed=s.seed,
    )
    t0_trace = records[0][0] if records else 0.0
    samples: list[Sample] = []
    tasks: list[asyncio.Task[None]] = []
    done = 0

    def finished(_: object) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(s.label, done, len(samples))

    timeout = httpx.Timeout(s.timeout_s, connect=min(10.0, s.timeout_s))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        for arrival, input_length, output_length, ids in records:
            at = (arrival - t0_trace) / s.speedup
            if at > s.duration_s:
                break
            delay = at - (time.perf_counter() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            n_in = min(input_length, s.max_prompt_tokens or input_length)
            n_out = min(output_length, s.max_tokens or output_length)
            sample = Sample(arrival_s=at, prompt_words=n_in)
            samples.append(sample)
            body = _body(s, prompt_text(ids, n_in, block_tokens, s.seed), n_out)
            task = asyncio.create_task(asyncio.wait_for(_one(client, s, sample, body), s.timeout_s + 5.0))
            task.add_done_callback(finished)
            tasks.append(task)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for sample, res in zip(samples, results, strict=True):
        if isinstance(res, BaseException) and sample.error is None:
            sample.error = f"{type(res).__name__}"
    wall = time.perf_counter() - started
    return _report(s, samples, wall)


def _report(s: LiveSettings, samples: list[Sample], wall: float) -> dict[str, Any]:
    ok = [x for x in samples if x.error is None]
    ttft = [x.ttft_ms for x in ok if x.ttft_ms is not None]
    e2e = [x.e2e_ms for x in ok if x.e2e_ms is not None]
    itl = [g for x in ok for g in x.itl_ms]
    span = samples[-1].arrival_s - samples[0].arrival_s if len(samples) > 1 else 0.0
    run = {
        "policy": s.label,
        "load": None,
        "speedup": s.speedup,
        "num_requests": len(samples),
        "errors": len(samples) - len(ok),
        "offered_rps": (len(samples) - 1) / span if span > 0 else None,
        "mean_ttft_ms": mean(ttft),
        "p50_ttft_ms": percentile(ttft, 50),
        "p90_ttft_ms": percentile(ttft, 90),
        "p99_ttft_ms": percentile(ttft, 99),
        "mean_itl_ms": mean(itl),
        "p99_itl_ms": percentile(itl, 99),
        "mean_e2e_ms": mean(e2e),
        "p50_e2e_ms": percentile(e2e, 50),
        "p90_e2e_ms": percentile(e2e, 90),
        "p99_e2e_ms": percentile(e2e, 99),
        "request_throughput_rps": len(ok) / wall if wall > 0 else 0.0,
        "output_chunks": sum(x.chunks for x in ok),
        "wall_time_s": wall,
    }
    errors: dict[str, int] = {}
    for x in samples:
        if x.error is not None:
            errors[x.error] = errors.get(x.error, 0) + 1
    return {
        "kind": "live",
        "kvroute_version": _native.__version__,
        "settings": {**asdict(s), "api_key": None},
        "runs": [run],
        "error_kinds": errors,
        "samples": [{"arrival_s": x.arrival_s, "ttft_ms": x.ttft_ms, "e2e_ms": x.e2e_ms} for x in samples],
    }


def run(s: LiveSettings, progress: ProgressFn | None = None) -> dict[str, Any]:
    return asyncio.run(run_async(s, progress))
