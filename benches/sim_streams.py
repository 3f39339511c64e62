"""How many concurrent streams, and streamed tokens per second, one ``kvroute sim`` process sustains.

Starts ``kvroute sim`` (one replica, loopback only) in a subprocess, so it has a core and a GIL of
its own, then opens C concurrent streaming ``/v1/completions`` requests from this process with a
minimal raw-socket HTTP client (an SSE event is counted when its ``data:`` line arrives; httpx
would cost more CPU than the server under test). Every run is bounded by ``--seconds``.

Two regimes per concurrency level:

* ``fast``: ``--time-scale`` large, so engine steps take no modelled time and the loop runs as
  fast as Python serves it: the process's serving ceiling (tokens/s).
* ``real``: ``--time-scale 1`` with the default preset: whether the process keeps up with the
  modelled step times (inter-token gaps near the model's, no stream lost).

    python benches/sim_streams.py                      # the default sweep, about 2 minutes
    python benches/sim_streams.py --concurrency 64 256 --regime fast --seconds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

HOST = "127.0.0.1"


@dataclass
class StreamStats:
    events: int = 0
    gaps: list[float] = field(default_factory=list)
    ttft: float | None = None
    done: bool = False
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
        return port


def request_bytes(port: int, max_tokens: int, i: int) -> bytes:
    body = json.dumps(
        {
            "model": "bench",
            "prompt": [1000 + (i * 31 + k) % 50000 for k in range(128)],
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    return head + body


async def one_stream(port: int, max_tokens: int, i: int, deadline: float) -> StreamStats:
    st = StreamStats()
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(HOST, port)
    except OSError as e:
        st.error = f"connect: {e}"
        return st
    try:
        writer.write(request_bytes(port, max_tokens, i))
        await writer.drain()
        tail = b""
        last = t0
        while time.perf_counter() < deadline:
            try:
                data = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.perf_counter()))
            except TimeoutError:
                break
            if not data:
                break
            buf = tail + data
            n = buf.count(b"data: {")
            if n:
                now = time.perf_counter()
                if st.ttft is None:
                    st.ttft = now - t0
                else:
                    st.gaps.append(now - last)
                last = now
                st.events += n
            if b"data: [DONE]" in buf:
                st.done = True
                break
            tail = buf[-16:]
    except OSError as e:
        st.error = str(e)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    return st


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run_level(port: int, concurrency: int, max_tokens: int, seconds: float) -> dict[str, float]:
    """C streams at once, until they finish or ``seconds`` pass."""
    deadline = time.perf_counter() + seconds
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_stream(port, max_tokens, i, deadline) for i in range(concurrency)))
    wall = time.perf_counter() - t0
    events = sum(r.events for r in results)
    gaps = [g for r in results for g in r.gaps]
    ttfts = [r.ttft for r in results if r.ttft is not None]
    return {
        "concurrency": concurrency,
        "streams_started": len(ttfts),
        "streams_done": sum(r.done for r in results),
        "errors": sum(r.error is not None for r in results),
        "tokens_per_s": events / wall,
        "wall_s": wall,
        "ttft_p50_ms": 1000 * pct(ttfts, 0.5),
        "ttft_p99_ms": 1000 * pct(ttfts, 0.99),
        "itl_p50_ms": 1000 * pct(gaps, 0.5),
        "itl_p99_ms": 1000 * pct(gaps, 0.99),
    }


def scrape(port: int) -> dict[str, float]:
    """The simulator's own step counters from /metrics."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("engine_steps", "modelled_step_seconds", "late_step_seconds"):
            if line.startswith(f"kvroute_sim:{name}_total{{"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def start_sim(port: int, time_scale: float, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "kvroute.cli", "sim", "--model", "bench", "--base-port", str(port),
        "--kv-events-port-base", "0", "--replay-port-base", "0", "--time-scale", str(time_scale),
        "--max-num-seqs", "4096", "--num-gpu-blocks", "200000", "--max-num-batched-tokens", "65536",
        *extra,
    ]  # fmt: skip
    # A pipe nobody reads could fill up and block the server; the file lives as long as it.
    log = tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.2):
            return proc
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"kvroute sim exited: {log.read().decode(errors='replace')}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("kvroute sim did not start within 60 s")


def stop_sim(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256, 1024])
    p.add_argument("--regime", choices=("fast", "real", "both"), default="both")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--seconds", type=float, default=8.0, help="bound of each level")
    p.add_argument("--fast-time-scale", type=float, default=1e6)
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    args = p.parse_args()
    regimes = ["fast", "real"] if args.regime == "both" else [args.regime]
    print(f"# kvroute sim streams; cpus={os.cpu_count()} max_tokens={args.max_tokens} bound={args.seconds}s")
    header = (
        "regime  conc  started  done  errors  tokens/s  ttft_p50_ms  ttft_p99_ms  itl_p50_ms  itl_p99_ms"
        "  steps  model_step_ms  late_ms/step"
    )
    if not args.json:
        print(header)
    for regime in regimes:
        scale = args.fast_time_scale if regime == "fast" else 1.0
        for c in args.concurrency:
            port = free_port()
            proc = start_sim(port, scale, [])
            try:
                r = asyncio.run(run_level(port, c, args.max_tokens, args.seconds))
                m = scrape(port)
            finally:
                stop_sim(proc)
            steps = max(1.0, m.get("engine_steps", 0.0))
            r["steps"] = steps
            r["modelled_step_ms"] = 1000 * m.get("modelled_step_seconds", 0.0) / steps
            r["late_ms_per_step"] = 1000 * m.get("late_step_seconds", 0.0) / steps
            if args.json:
                print(json.dumps({"regime": regime, **r}))
            else:
                print(
                    f"{regime:6}  {c:4}  {r['streams_started']:7.0f}  {r['streams_done']:4.0f}  "
                    f"{r['errors']:6.0f}  {r['tokens_per_s']:8.0f}  {r['ttft_p50_ms']:11.1f}  "
                    f"{r['ttft_p99_ms']:11.1f}  {r['itl_p50_ms']:10.1f}  {r['itl_p99_ms']:10.1f}  "
                    f"{r['steps']:5.0f}  {r['modelled_step_ms']:13.2f}  {r['late_ms_per_step']:12.2f}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
