"""``kvroute bench``: replay runs and their reports, the Dynamo comparison, the live load generator
against a streaming endpoint started here (loopback only), and the report math."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvroute
from kvroute.bench import dynamo, live, report
from kvroute.bench.cli import _floats
from kvroute.cli import main

TRACE = Path(__file__).parents[1] / ".." / "shared" / "traces" / "conversation_trace.jsonl"


def _read(out: Path, stem: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"{stem}.json").read_text())
    return data


def test_replay_on_a_generator_writes_json_markdown_and_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    argv = ["bench", "replay", "shared-prefix", "--requests", "80", "--policies", "kvroute,round_robin"]
    argv += ["--loads", "0.5,0.9", "--out", str(tmp_path), "--name", "r", "--quiet"]
    assert main(argv) == 0
    for f in ("r.json", "r.md", "r-ttft.png", "r-hit.png"):
        assert (tmp_path / f).stat().st_size > 100, f
        if f.endswith(".png"):
            assert (tmp_path / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = _read(tmp_path, "r")
    assert rep["kind"] == "replay"
    assert rep["capacity"]["policy"] == "round_robin"
    assert rep["capacity"]["rps"] > 0
    b = rep["bounds"]
    assert 0 < b["pooled_lru"] <= b["belady"] <= b["infinite"] < 1
    runs = rep["runs"]
    assert [(r["load"], r["policy"]) for r in runs] == [
        (0.5, "kvroute"),
        (0.5, "round_robin"),
        (0.9, "kvroute"),
        (0.9, "round_robin"),
    ]
    for r in runs:
        assert r["num_requests"] == 80
        assert r["offered_rps"] == pytest.approx(r["load"] * rep["capacity"]["rps"], rel=1e-6)
        assert r["p50_ttft_ms"] <= r["p90_ttft_ms"] <= r["p99_ttft_ms"]
        assert r["hit_vs_bound"] == pytest.approx(r["gpu_hit_ratio"] / b["pooled_lru"])
    assert [s["load"] for s in rep["summary"]] == [0.5, 0.9]
    assert rep["summary"][0]["mean_ttft_ms_best_baseline"] == "round_robin"
    md = (tmp_path / "r.md").read_text()
    assert "| load | policy | mean TTFT ms |" in md
    assert "pooled LRU" in md
    assert "x the best baseline" in md


def test_replay_of_a_trace_prefix_with_routers_and_given_capacity(tmp_path: Path) -> None:
    if not TRACE.is_file():
        pytest.skip("the conversation trace lives in the shared/ checkout")
    argv = ["bench", "replay", str(TRACE), "--limit", "60", "--policies", "kvroute", "--loads", "0.8"]
    argv += [
        "--capacity",
        "5",
        "--routers",
        "1,2",
        "--no-plots",
        "--no-bounds",
        "--out",
        str(tmp_path),
        "--quiet",
    ]
    assert main(argv) == 0
    rep = _read(tmp_path, "replay")
    assert rep["capacity"] == {"policy": "round_robin", "method": "given", "rps": 5.0}
    assert rep["bounds"] is None
    one, two = rep["runs"]
    assert (one["routers"], two["routers"]) == (1, 2)
    assert one["peer_messages"] == 0
    assert two["peer_messages"] > 0
    assert one["offered_rps"] == pytest.approx(4.0)
    assert rep["summary"][1]["hit_kept"] is not None
    assert not list(tmp_path.glob("*.png"))


def test_replay_with_azure_arrivals_and_bad_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    azure = TRACE.with_name("AzureLLMInferenceTrace_conv.csv")
    if not azure.is_file():
        pytest.skip("the Azure trace lives in the shared/ checkout")
    argv = ["bench", "replay", "doc-qa", "--requests", "40", "--policies", "round_robin", "--loads", "0.5"]
    argv += ["--arrival", "azure", "--arrival-trace", str(azure), "--capacity", "3", "--no-plots"]
    assert main([*argv, "--out", str(tmp_path), "--quiet"]) == 0
    assert _read(tmp_path, "replay")["runs"][0]["offered_rps"] == pytest.approx(1.5)
    for bad in (["--policies", "nope"], ["--loads", "0,1"], ["--param", "nope=1"], ["--routers", "x"]):
        with pytest.raises(SystemExit):
            main(["bench", "replay", "doc-qa", *bad])
    assert "unknown policy" in capsys.readouterr().err
    assert _floats("0.5, 0.8") == (0.5, 0.8)


def test_native_replay_progress_and_errors() -> None:
    seen: list[tuple[int, int]] = []
    r = kvroute.replay(
        "multi-turn", requests=600, policy="kvroute", progress=lambda d, t: seen.append((d, t))
    )
    assert seen == [(512, 600), (600, 600)]
    assert r["workload"] == "multi-turn"
    assert r["num_requests"] == 600
    assert sum(r["requests_per_replica"]) == 600
    assert len(r["prefill_tokens_per_replica"]) == 8

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        kvroute.replay("multi-turn", requests=600, progress=stop)
    with pytest.raises(kvroute.InvalidArgumentError, match="poisson"):
        kvroute.replay("multi-turn", requests=10, arrival="poisson")
    with pytest.raises(kvroute.InvalidArgumentError, match="cannot read trace"):
        kvroute.replay("no-such-file.jsonl")
    with pytest.raises(kvroute.UnknownPolicyError):
        kvroute.replay("doc-qa", requests=10, policy="nope")
    again = kvroute.replay("multi-turn", requests=600, policy="kvroute")
    assert {k: v for k, v in again.items() if k != "wall_time_s"} == {
        k: v for k, v in r.items() if k != "wall_time_s"
    }


def test_hit_bounds_and_workloads() -> None:
    b = kvroute.hit_bounds("doc-qa", requests=300)
    assert b["num_requests"] == 300
    assert b["workload"] == "doc-qa"
    assert 0.5 < b["pooled_lru"] <= b["belady"] <= b["infinite"] < 1
    small = kvroute.hit_bounds("doc-qa", requests=300, num_gpu_blocks=200, replicas=1)
    assert small["pooled_lru"] < b["pooled_lru"]
    block_tokens, recs = kvroute.load_workload(
        "tool-agent", requests=50, arrival="poisson", arrival_rate=100.0
    )
    assert block_tokens == 64
    assert len(recs) == 50
    assert recs[0][0] == 0.0
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(recs))
    assert 0.2 < recs[-1][0] < 1.0


def test_percentile_and_report_table_match_numpy() -> None:
    rng = np.random.default_rng(3)
    v = list(rng.exponential(100.0, 501))
    for q in (0, 50, 90, 99, 100):
        assert live.percentile(v, q) == pytest.approx(float(np.percentile(v, q)))
    assert live.percentile([], 50) == 0.0
    assert live.mean([]) == 0.0
    runs = [{"policy": "kvroute", "load": 0.5, "mean_ttft_ms": 12.4, "gpu_hit_ratio": 0.25, "preemptions": 3}]
    runs.append(
        {"policy": "kvroute", "load": 0.5, "routers": 4, "fanout_delay_ms": 1.0, "mean_ttft_ms": None}
    )
    md = report.table(runs)
    assert md.splitlines()[0] == "| load | policy | mean TTFT ms | GPU hit | preempt. |"
    assert "| 50% | kvroute | 12 | 0.250 | 3 |" in md
    assert "kvroute x4 routers (fan-out 1 ms) | - |" in md


def test_prompt_text_shares_prefixes_as_ids_do() -> None:
    a = live.prompt_text([1, 2, 3], 150, 64).split()
    b = live.prompt_text([1, 2, 9], 192, 64).split()
    assert (len(a), len(b)) == (150, 192)
    assert a[:128] == b[:128]
    assert a[128:150] != b[128:150]
    assert live.prompt_text([1], 10, 64, seed=1) != live.prompt_text([1], 10, 64, seed=2)
    assert len(set(live.VOCAB)) == 1024


def test_compare_dynamo(tmp_path: Path) -> None:
    python = dynamo.default_python()
    if python is None or not TRACE.is_file():
        pytest.skip("no interpreter with ai-dynamo-runtime, or no trace")
    small = tmp_path / "t.jsonl"
    small.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:40]))
    argv = ["bench", "replay", str(small), "--policies", "kvroute", "--loads", "0.5", "--compare", "dynamo"]
    assert main([*argv, "--dynamo-python", python, "--no-plots", "--out", str(tmp_path), "--quiet"]) == 0
    rep = _read(tmp_path, "replay")
    names = sorted(r["policy"] for r in rep["dynamo"])
    assert names == ["dynamo:kv_router", "dynamo:round_robin", "kvroute:kvroute", "kvroute:round_robin"]
    for r in rep["dynamo"]:
        assert r["load"] == 0.5
        assert r["num_requests"] == 40
        assert r["mean_ttft_ms"] > 0
    assert "Side by side with NVIDIA Dynamo" in (tmp_path / "replay.md").read_text()
    with pytest.raises(dynamo.DynamoError):
        dynamo.run("/nonexistent/python", str(small), workers=2, speedups=[1.0])


# --- bench live against a streaming OpenAI-style endpoint on loopback -----------------------------


class _Endpoint:
    """A tiny HTTP server that streams completions as server-sent events (``/v1/completions``
    and ``/v1/chat/completions``), one chunk per token, 2 ms apart; ``fail`` answers 500."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.bodies: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.port = 0

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self.server = server
        self.ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.run_until_complete(server.wait_closed())
        pending = asyncio.all_tasks(self.loop)
        for t in pending:
            t.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            path = lines[0].split()[1]
            length = next(
                int(v) for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length"
            )
            body = json.loads(await reader.readexactly(length))
            self.bodies.append(body)
            if self.fail:
                writer.write(
                    b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            chat = path.endswith("/chat/completions")
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.002)
                choice = {"delta": {"content": f"t{i}"}} if chat else {"text": f" t{i}"}
                writer.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
                await writer.drain()
            writer.write(b"data: [DONE]\n\n")
        finally:
            await writer.drain()
            writer.close()

    def __enter__(self) -> _Endpoint:
        self.thread.start()
        assert self.ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def endpoint() -> Iterator[_Endpoint]:
    with _Endpoint() as e:
        yield e


def test_live_streams_a_generator_open_loop(tmp_path: Path, endpoint: _Endpoint) -> None:
    pytest.importorskip("httpx")
    argv = ["bench", "live", "multi-turn", "--url", endpoint.url, "--requests", "30", "--speedup", "20"]
    argv += [
        "--max-tokens",
        "5",
        "--max-prompt-tokens",
        "300",
        "--out",
        str(tmp_path),
        "--quiet",
        "--label",
        "sim",
    ]
    assert main(argv) == 0
    rep = _read(tmp_path, "live")
    (run,) = rep["runs"]
    assert run["policy"] == "sim"
    assert run["num_requests"] == 30
    assert run["errors"] == 0
    assert 0 < run["p50_ttft_ms"] <= run["p99_ttft_ms"] < 5000
    assert run["mean_itl_ms"] >= 1.5
    assert run["mean_e2e_ms"] > run["mean_ttft_ms"]
    assert run["output_chunks"] == sum(min(5, b["max_tokens"]) for b in endpoint.bodies)
    assert len(endpoint.bodies) == 30
    assert all(b["stream"] and b["ignore_eos"] for b in endpoint.bodies)
    assert all(len(b["prompt"].split()) <= 300 for b in endpoint.bodies)
    assert len(rep["samples"]) == 30
    if report_has_matplotlib():
        assert (tmp_path / "live-latency.png").is_file()
    assert "| load | policy |" in (tmp_path / "live.md").read_text()


def test_live_chat_and_errors(tmp_path: Path, endpoint: _Endpoint) -> None:
    pytest.importorskip("httpx")
    s = live.LiveSettings(
        url=endpoint.url, source="doc-qa", requests=5, speedup=100.0, max_tokens=3, chat=True
    )
    rep = live.run(s)
    assert rep["runs"][0]["errors"] == 0
    assert "messages" in endpoint.bodies[0]
    with _Endpoint(fail=True) as bad:
        rep = live.run(
            live.LiveSettings(url=bad.url, source="doc-qa", requests=4, speedup=100.0, max_tokens=2)
        )
    assert rep["runs"][0]["errors"] == 4
    assert rep["error_kinds"] == {"HTTP 500": 4}
    argv = ["bench", "live", "doc-qa", "--url", "http://127.0.0.1:9", "--requests", "2", "--timeout", "2"]
    assert main([*argv, "--out", str(tmp_path), "--quiet", "--no-plots"]) == 1


def report_has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True
