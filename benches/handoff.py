"""Token handoff: TTFT and engine CPU per request, with and without handing the ids to the engine.

Loopback only; every phase is bounded. Processes: ``kvroute sim`` (1 replica, ``--time-scale
1000``: the modelled engine adds next to no time, so what remains is serving work -- parsing,
templating, tokenizing, streaming), two ``kvroute serve`` in front of it (``--token-handoff on``
and ``off``), and this script as the client.

For chat prompts of about 8K and 32K tokens (a system and a user message of fresh random words:
no cache hits), streaming requests with ``max_tokens=4`` go through one router, then the other, in
alternating blocks of ``--requests`` (twice each). Reported per path: TTFT p50/p99 (client side:
until the first non-empty content delta) and CPU seconds per request of the engine process and of
the router process (``/proc/PID/stat`` over each block). The engine side checks its work through
its own counters: with the handoff every prompt is served from ``kv_transfer_params.prompt_token_ids``
(``kvroute_sim:handoff_used_total``) and none is templated or tokenized; without, every one is.

    python benches/handoff.py                 # about 15 seconds
    python benches/handoff.py --requests 4 --sizes 8192
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import subprocess
import time
import urllib.request
from pathlib import Path

from router_overhead import HOST, WORDS, cpu_seconds, free_port, pct, spawn, stop

MODEL = "kvroute-sim"
_CONTENT = re.compile(rb'"content":"[^"]')


def chat_body(rng: random.Random, tokens: int) -> bytes:
    words = [rng.choice(WORDS) for _ in range(int(tokens / 1.036))]  # ~1.04 tokens per word
    cut = len(words) // 4
    messages = [
        {"role": "system", "content": f"[{rng.getrandbits(64):x}] " + " ".join(words[:cut])},
        {"role": "user", "content": " ".join(words[cut:])},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": True}
    return json.dumps(body).encode()


async def ttft(port: int, body: bytes) -> float:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(
            (
                f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            + body
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        if " 200 " not in head.split("\r\n", 1)[0]:
            raise RuntimeError(f"{head.splitlines()[0]}: {(await reader.read())[:300]!r}")
        first = None
        data = b""
        while chunk := await reader.read(65536):
            data += chunk
            if first is None and _CONTENT.search(data):
                first = time.perf_counter() - t0
        if first is None or b"[DONE]" not in data:
            raise RuntimeError("no content streamed")
        return first
    finally:
        writer.close()


def counters(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name in ("tokenized_requests", "reused_prompt_token_ids_requests", "handoff_used"):
        m = re.search(rf"^kvroute_sim:{name}_total\{{[^}}]*\}} (\S+)", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def wait_channel(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{HOST}:{port}/status", timeout=10) as r:
            status = json.loads(r.read())
        if status["backends"][0]["token_handoff"]:
            return
        time.sleep(0.1)
    raise RuntimeError("the router did not discover the token channel")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 32000])
    ap.add_argument("--requests", type=int, default=20, help="requests per block (two blocks per path)")
    ap.add_argument("--out", default="bench-out/handoff.json")
    args = ap.parse_args()
    procs: list[subprocess.Popen[str]] = []
    report: dict[str, object] = {}
    try:
        sim_port, ev, rp = free_port(), free_port(), free_port()
        sim, _ = spawn(
            [
                *("sim", "--replicas", "1", "--base-port", str(sim_port), "--kv-events-port-base", str(ev)),
                *("--replay-port-base", str(rp), "--time-scale", "1000", "--max-model-len", "40000"),
            ],
            "replica 0:",
        )
        procs.append(sim)
        backend = f"http://{HOST}:{sim_port};events=tcp://{HOST}:{ev};replay=tcp://{HOST}:{rp};name=e0"
        routers: dict[str, tuple[int, int]] = {}
        for mode in ("on", "off"):
            port = free_port()
            proc, _ = spawn(
                [
                    *("serve", "--backends", backend, "--port", str(port), "--token-handoff", mode),
                    *("--max-model-len", "40000", "--log-level", "warning"),
                ],
                "OpenAI API at",
            )
            procs.append(proc)
            routers[mode] = (port, proc.pid)
        wait_channel(routers["on"][0])
        rng = random.Random(0)
        for size in args.sizes:
            for mode in ("on", "off"):  # warm-up
                asyncio.run(ttft(routers[mode][0], chat_body(rng, size)))
            lat: dict[str, list[float]] = {"on": [], "off": []}
            cpu: dict[str, list[float]] = {"on": [0.0, 0.0], "off": [0.0, 0.0]}
            before = counters(sim_port)
            work = {"on": dict.fromkeys(before, 0.0), "off": dict.fromkeys(before, 0.0)}
            for mode in ("on", "off", "on", "off"):
                port, pid = routers[mode]
                bodies = [chat_body(rng, size) for _ in range(args.requests)]
                c0 = counters(sim_port)
                e0, r0 = cpu_seconds(sim.pid), cpu_seconds(pid)
                for body in bodies:
                    lat[mode].append(asyncio.run(ttft(port, body)))
                cpu[mode][0] += cpu_seconds(sim.pid) - e0
                cpu[mode][1] += cpu_seconds(pid) - r0
                c1 = counters(sim_port)
                for k in c1:
                    work[mode][k] += c1[k] - c0[k]
            n = 2 * args.requests
            rows = {}
            for mode in ("on", "off"):
                rows[mode] = {
                    "ttft_p50_ms": 1e3 * pct(lat[mode], 0.5),
                    "ttft_p99_ms": 1e3 * pct(lat[mode], 0.99),
                    "engine_cpu_ms_per_request": 1e3 * cpu[mode][0] / n,
                    "router_cpu_ms_per_request": 1e3 * cpu[mode][1] / n,
                    **{f"engine_{k}": v for k, v in work[mode].items()},
                }
                r = rows[mode]
                print(
                    f"~{size} tokens, handoff {mode:>3}: TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
                    f"p99 {r['ttft_p99_ms']:.1f} ms; CPU per request: engine "
                    f"{r['engine_cpu_ms_per_request']:.1f} ms, "
                    f"router {r['router_cpu_ms_per_request']:.1f} ms; "
                    f"engine tokenized {r['engine_tokenized_requests']:.0f}/{n}, "
                    f"handed off {r['engine_handoff_used']:.0f}/{n}",
                    flush=True,
                )
            report[str(size)] = rows
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                stop(p)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
