"""Routing overhead of ``kvroute serve``, and the request rate one router process sustains.

Loopback only; every phase is bounded. Processes (each with its own core share and GIL):

* ``kvroute sim`` (2 replicas, ``--time-scale 1000``: the engine model adds next to no time);
* ``kvroute serve`` in front of it;
* this script: the clients (a minimal raw-socket HTTP/1.1 keep-alive client, so the client costs
  less than what it measures), and for the rate phase a *null backend* (canned answers, no
  engine), so that the router is the only thing being saturated.

Phases:

1. **Overhead**: for chat prompts of about 1K, 8K and 32K tokens (a system and a user message of
   fresh random words, so no request hits a cache), the same stream of non-streaming
   ``max_tokens=1`` requests is sent directly to sim replica 0 and through the router (which has
   only that replica as backend), interleaved one by one. Reported: p50 and p99 of each path and
   the added p50/p99 (router minus direct), plus the router's own stage timings from its
   ``/metrics`` (tokenize, decide, total before the upstream send: mean per request). The sim
   tokenizes every prompt again with HF ``tokenizers`` and publishes KV events that the router
   ingests while the next request arrives, all on two shared cores, so the comparison is repeated
   against the null backend: the router's own overhead.
2. **Rate**: C concurrent keep-alive connections send short chat requests through the router for
   ``--rate-seconds`` (null backend; then the sim replicas); reported: completed requests/s and the
   router process's CPU use (of one core).

    python benches/router_overhead.py                 # about 2 minutes
    python benches/router_overhead.py --requests 20 --rate-seconds 3 --sizes 1024 8192
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"
MODEL = "kvroute-sim"
WORDS = [
    *("system", "router", "cache", "block", "token", "prefix", "engine", "replica", "latency", "request"),
    *("stream", "alpha", "beta", "gamma", "delta", "omega", "vector", "matrix", "kernel", "tensor"),
    *("batch", "queue", "worker", "decode", "prefill", "schedule", "memory"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


# -- a minimal HTTP/1.1 client (blocking, keep-alive) ---------------------------------------------


class Conn:
    def __init__(self, port: int) -> None:
        self.port = port
        self.sock = socket.create_connection((HOST, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _read_until(self, sep: bytes) -> bytes:
        while sep not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk
        head, _, self.buf = self.buf.partition(sep)
        return head

    def _read_n(self, n: int) -> bytes:
        while len(self.buf) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        req = (
            f"POST {path} HTTP/1.1\r\nHost: {HOST}:{self.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.sock.sendall(req)
        head = self._read_until(b"\r\n\r\n").decode("latin-1")
        status = int(head.split(" ", 2)[1])
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in head.split("\r\n")[1:])}
        if "content-length" in headers:
            return status, self._read_n(int(headers["content-length"]))
        out = b""
        while True:  # chunked
            size = int(self._read_until(b"\r\n"), 16)
            if size == 0:
                self._read_until(b"\r\n")
                return status, out
            out += self._read_n(size)
            self._read_n(2)


async def aio_post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int, body: bytes) -> int:
    writer.write(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status = int(head.split(" ", 2)[1])
    m = re.search(r"(?i)content-length:\s*(\d+)", head)
    if m:
        await reader.readexactly(int(m.group(1)))
    else:
        while True:
            size = int(await reader.readuntil(b"\r\n"), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return status


# -- processes ------------------------------------------------------------------------------------


def spawn(args: list[str], ready: str, timeout: float = 60.0) -> tuple[subprocess.Popen[str], list[str]]:
    """Starts ``python -m kvroute.cli ARGS`` and waits for a stdout line containing ``ready``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvroute.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{args[0]} exited: {lines}")
        lines.append(line.strip())
        if ready in line:
            return proc, lines
    proc.kill()
    raise RuntimeError(f"{args[0]} did not start: {lines}")


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


NULL_BACKEND = r"""
import json, sys, uvicorn
BODY = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "kvroute-sim",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "kvroute-sim", "max_model_len": 40000}]}).encode()
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = MODELS if scope["path"] == "/v1/models" else b"" if scope["path"] == "/metrics" else BODY
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})
print("ready", flush=True)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="error", access_log=False, lifespan="off")
"""


# -- prompts --------------------------------------------------------------------------------------


class Prompts:
    def __init__(self, seed: int = 0) -> None:
        from kvroute.tokenization import Tokenizer

        self.tok = Tokenizer()
        self.rng = random.Random(seed)
        sample = " ".join(self.rng.choice(WORDS) for _ in range(4000))
        self.tokens_per_word = len(self.tok.encode(sample)) / 4000

    def chat(self, tokens: int) -> tuple[bytes, int]:
        words = int(tokens / self.tokens_per_word)
        system = f"[{self.rng.getrandbits(64):x}] " + " ".join(
            self.rng.choice(WORDS) for _ in range(words // 4)
        )
        user = " ".join(self.rng.choice(WORDS) for _ in range(words - words // 4))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 1}
        return json.dumps(body).encode(), words


# -- phases ---------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def router_stages(port: int) -> dict[str, tuple[float, float]]:
    conn = socket.create_connection((HOST, port))
    conn.sendall(f"GET /metrics HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
    data = b""
    while chunk := conn.recv(1 << 16):
        data += chunk
    conn.close()
    text = data.decode()
    out = {}
    for stage in ("tokenize", "decide", "total"):
        s = re.search(rf'kvroute_routing_overhead_seconds_sum{{stage="{stage}"}} (\S+)', text)
        c = re.search(rf'kvroute_routing_overhead_seconds_count{{stage="{stage}"}} (\S+)', text)
        out[stage] = (float(s.group(1)) if s else 0.0, float(c.group(1)) if c else 0.0)
    return out


def overhead(
    label: str, direct_port: int, router_port: int, sizes: list[int], requests: int
) -> list[dict[str, float]]:
    prompts = Prompts()
    direct, routed = Conn(direct_port), Conn(router_port)
    results = []
    for size in sizes:
        n = requests if size <= 8192 else max(10, requests // 2)
        for _ in range(3):  # warm up both paths (connections, caches of code paths)
            for c in (direct, routed):
                status, body = c.post("/v1/chat/completions", prompts.chat(size)[0])
                assert status == 200, body[:300]
        before = router_stages(router_port)
        lat: dict[str, list[float]] = {"direct": [], "router": []}
        tokens = []
        for i in range(2 * n):
            path = ("direct", "router")[i % 2]
            body, _ = prompts.chat(size)
            c = direct if path == "direct" else routed
            t0 = time.perf_counter()
            status, resp = c.post("/v1/chat/completions", body)
            lat[path].append(time.perf_counter() - t0)
            assert status == 200, resp[:300]
            tokens.append(json.loads(resp)["usage"]["prompt_tokens"])
        after = router_stages(router_port)
        row = {"target_tokens": size, "prompt_tokens": statistics.median(tokens), "requests": n}
        for path in ("direct", "router"):
            row[f"{path}_p50_ms"] = 1e3 * pct(lat[path], 0.5)
            row[f"{path}_p99_ms"] = 1e3 * pct(lat[path], 0.99)
        row["added_p50_ms"] = row["router_p50_ms"] - row["direct_p50_ms"]
        row["added_p99_ms"] = row["router_p99_ms"] - row["direct_p99_ms"]
        for stage, (s1, c1) in after.items():
            s0, c0 = before[stage]
            row[f"{stage}_mean_ms"] = 1e3 * (s1 - s0) / max(c1 - c0, 1)
        results.append(row)
        print(
            f"[{label}] {size:>6} tokens ({row['prompt_tokens']:.0f}): "
            f"direct p50 {row['direct_p50_ms']:.2f} ms p99 {row['direct_p99_ms']:.2f} | "
            f"router p50 {row['router_p50_ms']:.2f} p99 {row['router_p99_ms']:.2f} | "
            f"added p50 {row['added_p50_ms']:+.2f} p99 {row['added_p99_ms']:+.2f} ms | in router: "
            f"tokenize {row['tokenize_mean_ms']:.3f}, decide {row['decide_mean_ms']:.3f}, "
            f"total {row['total_mean_ms']:.3f} ms",
            flush=True,
        )
    return results


async def rate(port: int, router_pid: int, concurrency: int, seconds: float) -> dict[str, float]:
    prompts = Prompts(seed=1)
    bodies = [prompts.chat(100)[0] for _ in range(64)]
    done = 0
    errors = 0
    stop_at = time.monotonic() + seconds

    async def client(i: int) -> None:
        nonlocal done, errors
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            k = i
            while time.monotonic() < stop_at:
                status = await aio_post(reader, writer, port, bodies[k % len(bodies)])
                k += 1
                if status == 200:
                    done += 1
                else:
                    errors += 1
        finally:
            writer.close()

    cpu0, t0 = cpu_seconds(router_pid), time.monotonic()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    elapsed = time.monotonic() - t0
    cpu = cpu_seconds(router_pid) - cpu0
    return {"requests_per_s": done / elapsed, "errors": errors, "router_cpu": cpu / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 8192, 32768])
    ap.add_argument("--requests", type=int, default=60, help="requests per path and size (half at 32K)")
    ap.add_argument("--rate-seconds", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", default="bench-out/router_overhead.json")
    args = ap.parse_args()

    procs: list[subprocess.Popen[str]] = []
    report: dict[str, object] = {"cpus": os.cpu_count()}
    try:
        sim_port, ev, rp = free_port(), free_port(), free_port()
        sim, _ = spawn(
            [
                *("sim", "--replicas", "2", "--base-port", str(sim_port), "--kv-events-port-base", str(ev)),
                *("--replay-port-base", str(rp), "--time-scale", "1000", "--max-model-len", "40000"),
            ],
            "replica 1:",
        )
        procs.append(sim)
        backends = [
            f"http://{HOST}:{sim_port + i};events=tcp://{HOST}:{ev + i};replay=tcp://{HOST}:{rp + i}"
            for i in range(2)
        ]
        router_port = free_port()
        common = ["--max-model-len", "40000", "--log-level", "warning", "--metrics-interval-s", "1"]
        router, _ = spawn(
            ["serve", "--backends", backends[0], "--port", str(router_port), *common], "OpenAI API at"
        )
        procs.append(router)
        print(
            f"overhead: {args.requests} requests per path and size, interleaved, non-streaming max_tokens=1",
            flush=True,
        )
        report["overhead_sim"] = overhead("sim", sim_port, router_port, args.sizes, args.requests)
        stop(router)

        null_port = free_port()
        null = subprocess.Popen(
            [sys.executable, "-c", NULL_BACKEND, str(null_port)], stdout=subprocess.PIPE, text=True
        )
        procs.append(null)
        assert null.stdout is not None
        null.stdout.readline()
        null_spec = f"http://{HOST}:{null_port};events=none"
        port = free_port()
        router, _ = spawn(["serve", "--backends", null_spec, "--port", str(port), *common], "OpenAI API at")
        procs.append(router)
        report["overhead_null"] = overhead("null backend", null_port, port, args.sizes, args.requests)
        stop(router)
        rates = {}
        for name, spec in (
            ("null backend", null_spec),
            ("2 sim replicas", ",".join(backends)),
        ):
            port = free_port()
            router, _ = spawn(["serve", "--backends", spec, "--port", str(port), *common], "OpenAI API at")
            procs.append(router)
            time.sleep(1.0)
            r = asyncio.run(rate(port, router.pid, args.concurrency, args.rate_seconds))
            rates[name] = r
            print(
                f"rate via router ({name}, {args.concurrency} connections, ~100-token chat, max_tokens=1): "
                f"{r['requests_per_s']:.0f} req/s, router CPU {100 * r['router_cpu']:.0f}% of a core, "
                f"{r['errors']} errors",
                flush=True,
            )
            stop(router)
        report["rate"] = rates
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
