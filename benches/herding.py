"""The herding problem: several router replicas, one new shared prefix, with and without fan-out.

Loopback only; every phase is bounded. Processes: one ``kvroute sim`` with 4 replicas (the
``llama3-8b-h100`` preset, slowed to ``--time-scale 0.25`` so that modelled engine time dwarfs the
noise of 6 processes sharing the machine), 4 ``kvroute serve`` replicas in front of all 4 engines
(the same configuration, as behind a load balancer), and this script as the client.

Each *burst* is ``--burst`` streaming completions, round-robin through the 4 routers, sharing one
prefix nobody has seen (``--prefix`` tokens of fresh random words), each with a unique suffix
(``--suffix`` tokens). The first request leads; the rest follow ``--lead`` seconds later, spread
over ``--spread`` seconds: by then every router's index knows, from the engine's KV events, that
one engine holds the prefix. Serving the burst from that engine's cache is cheap until the queue
there costs more than computing the prefix elsewhere. Without fan-out each router sees only its own
quarter of that queue, so all four keep sending there about four times too long: the herd. With
fan-out (``--peers`` between the 4 routers) every router books every reservation (and speculates
every routed prefix) as it happens. ``--lead 0 --spread 0`` sends the whole burst at once instead.

Reported per configuration (``--bursts`` bursts after one warm-up burst, fresh processes per
configuration): requests per engine, their peak queue (running + waiting, sampled every 50 ms) and
computed prompt tokens (prefix-cache queries minus hits), from the engines' own ``/metrics``; the
max/min spread across engines; TTFT (client side: time to the first streamed token) p50 and p99.

    python benches/herding.py                        # about 2 minutes
    python benches/herding.py --lead 0 --spread 0    # the whole burst at once
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from router_overhead import HOST, WORDS, free_port, pct, spawn, stop

MODEL = "kvroute-sim"
ENGINES = 4
ROUTERS = 4
TOKENS_PER_WORD = 1.0
"""Each word of :data:`WORDS` (with its space) is one token of the DeepSeek tokenizer."""


def words(rng: random.Random, tokens: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(int(tokens / TOKENS_PER_WORD)))


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        text: str = r.read().decode()
        return text


def engine_counters(port: int) -> dict[str, float]:
    text = get(f"http://{HOST}:{port}/metrics")

    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(rf"^{name}\{{[^}}]*\}} (\S+)", text, re.M))

    return {
        "requests": total("vllm:request_success_total"),
        "queries": total("vllm:prefix_cache_queries_total"),
        "hits": total("vllm:prefix_cache_hits_total"),
        "running": total("vllm:num_requests_running") + total("vllm:num_requests_waiting"),
    }


async def stream(port: int, body: bytes) -> float:
    """Sends one streaming completion; returns the time to its first token (seconds)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(
            (
                f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            + body
        )
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status = int(head.split(" ", 2)[1])
        if status != 200:
            raise RuntimeError(f"status {status}: {(await reader.read())[:300]!r}")
        ttft = None
        data = b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                break
            data += chunk
            if ttft is None and b'"text"' in data:
                ttft = time.perf_counter() - t0
        if ttft is None or b"[DONE]" not in data:
            raise RuntimeError("the stream ended early")
        return ttft
    finally:
        writer.close()


async def queue_depth(port: int) -> float:
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        text = (await reader.read()).decode()
    finally:
        writer.close()
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)", text, re.M)
    )


async def peaks(engine_ports: list[int], done: asyncio.Event, every_s: float = 0.05) -> list[float]:
    """The largest number of requests each engine held (running + waiting) while ``done`` is unset."""
    top = [0.0] * len(engine_ports)
    while not done.is_set():
        depths = await asyncio.gather(*(queue_depth(p) for p in engine_ports))
        top = [max(a, b) for a, b in zip(top, depths, strict=True)]
        await asyncio.sleep(every_s)
    return top


async def burst(
    ports: list[int],
    engine_ports: list[int],
    rng: random.Random,
    n: int,
    prefix: int,
    suffix: int,
    out: int,
    spread_s: float,
    lead_s: float,
) -> tuple[list[float], list[float]]:
    shared = f"[{rng.getrandbits(64):x}] " + words(rng, prefix)
    bodies = [
        json.dumps(
            {
                "model": MODEL,
                "prompt": shared + f" [{i}:{rng.getrandbits(32):x}] " + words(rng, suffix),
                "max_tokens": out,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        for i in range(n)
    ]

    async def send(i: int, body: bytes) -> float:
        # Request 0 leads; the others follow lead_s later, spread evenly over spread_s.
        await asyncio.sleep(0.0 if i == 0 else lead_s + (i - 1) * spread_s / max(n - 1, 1))
        return await stream(ports[i % len(ports)], body)

    done = asyncio.Event()
    watcher = asyncio.create_task(peaks(engine_ports, done))
    try:
        ttfts = list(await asyncio.gather(*(send(i, b) for i, b in enumerate(bodies))))
    finally:
        done.set()
    return ttfts, await watcher


def wait_idle(engine_ports: list[int], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while any(engine_counters(p)["running"] for p in engine_ports):
        if time.monotonic() > deadline:
            raise RuntimeError("the engines did not go idle")
        time.sleep(0.2)


def wait_ready(router_ports: list[int], fanout: bool, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            ok = True
            for port in router_ports:
                status = json.loads(get(f"http://{HOST}:{port}/status"))
                ok &= all(b["healthy"] and b["engines"][0]["events"]["connected"] for b in status["backends"])
                if fanout:
                    ok &= all(link["up"] and link["sent"] > 0 for link in status["peers"]["links"])
                    ok &= len(status["peers"]["origins"]) == ROUTERS - 1
            if ok:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the routers did not get ready")
        time.sleep(0.2)


def start_sim(time_scale: float) -> tuple[subprocess.Popen[str], int, int, int]:
    """``kvroute sim`` with 4 replicas on consecutive ports (retried if one of them was taken)."""
    for attempt in range(3):
        sim_port, ev, rp = free_port(), free_port(), free_port()
        try:
            sim, _ = spawn(
                [
                    *("sim", "--replicas", str(ENGINES), "--base-port", str(sim_port)),
                    *("--kv-events-port-base", str(ev), "--replay-port-base", str(rp)),
                    *("--max-model-len", "40000", "--time-scale", str(time_scale)),
                ],
                f"replica {ENGINES - 1}:",
            )
        except RuntimeError:
            if attempt == 2:
                raise
            continue
        return sim, sim_port, ev, rp
    raise AssertionError("unreachable")


def run(fanout: bool, args: argparse.Namespace) -> dict[str, object]:
    procs: list[subprocess.Popen[str]] = []
    try:
        sim, sim_port, ev, rp = start_sim(args.time_scale)
        procs.append(sim)
        engine_ports = [sim_port + i for i in range(ENGINES)]
        backends = ",".join(
            f"http://{HOST}:{sim_port + i};events=tcp://{HOST}:{ev + i};replay=tcp://{HOST}:{rp + i};"
            f"name=e{i}"
            for i in range(ENGINES)
        )
        peer_ports = [free_port() for _ in range(ROUTERS)]
        peers = ",".join(f"tcp://{HOST}:{p}" for p in peer_ports)
        router_ports = []
        for i in range(ROUTERS):
            port = free_port()
            cmd = ["serve", "--backends", backends, "--port", str(port), "--log-level", "error"]
            cmd += ["--max-model-len", "40000", "--token-handoff", "off"]
            if fanout:
                cmd += [
                    "--peers",
                    peers,
                    "--peer-bind",
                    f"tcp://{HOST}:{peer_ports[i]}",
                    "--router-name",
                    f"r{i}",
                ]
            proc, _ = spawn(cmd, "OpenAI API at")
            procs.append(proc)
            router_ports.append(port)
        wait_ready(router_ports, fanout)
        rng = random.Random(args.seed)
        ttfts: list[float] = []
        per_burst = []
        for b in range(-1, args.bursts):  # burst -1 warms up connections and code paths, not counted
            wait_idle(engine_ports)
            before = [engine_counters(p) for p in engine_ports]
            ttfts_b, top = asyncio.run(
                burst(
                    router_ports,
                    engine_ports,
                    rng,
                    args.burst,
                    args.prefix,
                    args.suffix,
                    args.output,
                    args.spread,
                    args.lead,
                )
            )
            wait_idle(engine_ports)
            after = [engine_counters(p) for p in engine_ports]
            reqs = [a["requests"] - x["requests"] for a, x in zip(after, before, strict=True)]
            computed = [
                (a["queries"] - x["queries"]) - (a["hits"] - x["hits"])
                for a, x in zip(after, before, strict=True)
            ]
            label = f"  {'fan-out' if fanout else 'independent'} burst {b}{' (warm-up)' if b < 0 else ''}"
            print(
                f"{label}: requests per engine {[int(r) for r in reqs]}, peak queue {[int(t) for t in top]}, "
                f"computed prompt tokens {[int(c) for c in computed]}, "
                f"TTFT p50 {1e3 * pct(ttfts_b, 0.5):.0f} ms p99 {1e3 * pct(ttfts_b, 0.99):.0f} ms",
                flush=True,
            )
            if b >= 0:
                ttfts += ttfts_b
                per_burst.append({"requests": reqs, "peak_queue": top, "computed_tokens": computed})
        routers = router_figures(router_ports) if fanout else {}
        if routers:
            print(f"  routers: {routers}", flush=True)
        return {
            "fanout": fanout,
            "routers": routers,
            "bursts": per_burst,
            "max_min_requests": [max(x["requests"]) / max(min(x["requests"]), 1) for x in per_burst],
            "max_min_peak_queue": [max(x["peak_queue"]) / max(min(x["peak_queue"]), 1) for x in per_burst],
            "prefix_computations": [sum(c > args.prefix for c in x["computed_tokens"]) for x in per_burst],
            "ttft_p50_ms": 1e3 * pct(ttfts, 0.5),
            "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
            "ttft_max_ms": 1e3 * max(ttfts),
        }
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                stop(p)


def router_figures(router_ports: list[int]) -> dict[str, object]:
    """The routers' own view of the bursts: fan-out latency (median over routers of their p50 and
    p99) and how many decisions took turns (paced) or booked ghosts (hedged)."""
    lat: dict[str, list[float]] = {"0.5": [], "0.99": []}
    paced = hedged = 0
    for port in router_ports:
        for line in get(f"http://{HOST}:{port}/metrics").splitlines():
            for q in lat:
                if line.startswith(f'kvroute_peer_batch_latency_seconds{{quantile="{q}"}}'):
                    lat[q].append(float(line.split()[-1]))
            if line.startswith("kvroute_scheduler_paced_total"):
                paced += int(float(line.split()[-1]))
            if line.startswith("kvroute_scheduler_hedged_total"):
                hedged += int(float(line.split()[-1]))
    return {
        "fanout_latency_p50_ms": 1e3 * pct(lat["0.5"], 0.5) if lat["0.5"] else None,
        "fanout_latency_p99_ms": 1e3 * pct(lat["0.99"], 0.5) if lat["0.99"] else None,
        "paced": paced,
        "hedged": hedged,
    }


def fmt(xs: object) -> str:
    assert isinstance(xs, list)
    return ", ".join(f"{x:.2f}" for x in xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--burst", type=int, default=64, help="requests per burst")
    ap.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=512, help="unique suffix tokens")
    ap.add_argument("--output", type=int, default=32, help="generated tokens per request")
    ap.add_argument("--spread", type=float, default=0.5, help="seconds over which the burst arrives")
    ap.add_argument(
        "--lead", type=float, default=1.5, help="seconds between the first request and the rest of the burst"
    )
    ap.add_argument(
        "--time-scale", type=float, default=0.25, help="engine speed vs real time (< 1: slower, less noise)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-out/herding.json")
    args = ap.parse_args()
    socket.setdefaulttimeout(30)
    report: dict[str, dict[str, object]] = {}
    for fanout in (False, True):
        print(f"{'with' if fanout else 'without'} fan-out:", flush=True)
        r = run(fanout, args)
        report["fanout" if fanout else "independent"] = r
        print(
            f"  => max/min requests per engine {fmt(r['max_min_requests'])}, "
            f"max/min peak queue {fmt(r['max_min_peak_queue'])}; "
            f"TTFT p50 {r['ttft_p50_ms']:.0f} ms, p99 {r['ttft_p99_ms']:.0f} ms",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **report}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
