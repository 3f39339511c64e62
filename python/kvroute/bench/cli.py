"""``kvroute bench replay`` and ``kvroute bench live``: flags -> frozen settings -> run -> report.

Registered on the main parser by :func:`add_parser`; :func:`run` executes the parsed command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kvroute import GENERATORS, POLICIES, POLICY_PARAMS, SIM_PRESETS
from kvroute.bench import dynamo, live, replay, report
from kvroute.bench.progress import Progress

N = TypeVar("N", int, float)


def _positive(text: str, kind: Callable[[str], N], what: str) -> tuple[N, ...]:
    """Comma-separated positive values of one type (argparse ``type=``)."""
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from e
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive {what}, got {text!r}")
    return values


def _floats(text: str) -> tuple[float, ...]:
    return _positive(text, float, "numbers")


def _ints(text: str) -> tuple[int, ...]:
    return _positive(text, int, "integers")


def _policies(text: str) -> tuple[str, ...]:
    names = tuple(POLICIES) if text == "all" else tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown policy {unknown} (known: {', '.join(POLICIES)}, or all)")
    return names


def _param(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    if not sep or name not in POLICY_PARAMS:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE with NAME one of {', '.join(POLICY_PARAMS)}")
    try:
        return name, float(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{name}: not a number: {value!r}") from e


def _workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help=f"a Mooncake JSONL trace, or a generator: {', '.join(GENERATORS)}")
    p.add_argument(
        "--requests",
        "--limit",
        type=int,
        default=None,
        help="requests to use (trace: the first N; generators: 2000)",
    )
    p.add_argument(
        "--arrival",
        choices=("trace", "trace-spread", "poisson", "azure"),
        default="trace",
        help="arrival process before load scaling (default: the workload's own)",
    )
    p.add_argument(
        "--arrival-rate", type=float, default=None, help="poisson: its rate; azure: rescale to this rate"
    )
    p.add_argument("--arrival-trace", default=None, help="azure: an AzureLLMInferenceTrace_*.csv file")
    p.add_argument("--seed", type=int, default=0)


def _output_flags(p: argparse.ArgumentParser, default_stem: str) -> None:
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder (default: bench-out)")
    p.add_argument("--name", default=default_stem, help=f"file name stem (default: {default_stem})")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table on stdout")


def add_parser(sub: Any) -> None:
    """Adds ``bench`` (with ``replay`` and ``live``) to the main parser's subcommands."""
    bench = sub.add_parser(
        "bench", help="benchmarks: trace replay on simulated engines, live load generation"
    )
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)

    r = bsub.add_parser(
        "replay", help="replay a workload through the router on simulated engines (virtual time)"
    )
    _workload_flags(r)
    r.add_argument(
        "--policies", type=_policies, default=("kvroute", "round_robin"), help="comma-separated, or all"
    )
    r.add_argument(
        "--loads",
        type=_floats,
        default=(0.5, 0.8, 0.95),
        help="fractions of round robin's capacity (0.5,0.8,0.95)",
    )
    r.add_argument(
        "--capacity", type=float, default=None, help="round robin's capacity in req/s (skips measuring it)"
    )
    r.add_argument("--replicas", type=int, default=8)
    r.add_argument("--preset", choices=SIM_PRESETS, default=SIM_PRESETS[0])
    r.add_argument(
        "--gpu-blocks", type=int, default=None, help="GPU KV blocks per replica (default: the preset's)"
    )
    r.add_argument("--cpu-blocks", type=int, default=0, help="CPU offload blocks per replica (default 0)")
    r.add_argument("--routers", type=_ints, default=(1,), help="router replicas, e.g. 1,4 (default 1)")
    r.add_argument("--fanout-delay-ms", type=float, default=1.0, help="peer fan-out delay between routers")
    r.add_argument("--no-fanout", action="store_true", help="routers do not share reservations")
    r.add_argument("--event-delay-ms", type=float, default=5.0, help="KV-event delay from engine to router")
    r.add_argument("--param", type=_param, action="append", default=[], help="kvroute policy knob NAME=VALUE")
    r.add_argument("--no-bounds", action="store_true", help="skip the offline hit-ratio bounds")
    r.add_argument("--compare", choices=("dynamo",), default=None, help="also run NVIDIA Dynamo's own replay")
    r.add_argument(
        "--dynamo-python",
        default=dynamo.default_python(),
        help="interpreter with ai-dynamo-runtime "
        f"(default: $KVROUTE_DYNAMO_PYTHON or {dynamo.DEFAULT_DYNAMO_PYTHON})",
    )
    _output_flags(r, "replay")

    lv = bsub.add_parser("live", help="open-loop load against an OpenAI-compatible endpoint")
    _workload_flags(lv)
    lv.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    lv.add_argument("--model", default="default")
    lv.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this")
    lv.add_argument("--max-tokens", type=int, default=None, help="cap each request's output tokens")
    lv.add_argument("--max-prompt-tokens", type=int, default=None, help="cap each prompt's length (words)")
    lv.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default /v1/completions)")
    lv.add_argument("--no-ignore-eos", action="store_true", help="do not send vLLM's ignore_eos")
    lv.add_argument("--api-key", default=None)
    lv.add_argument("--duration", type=float, default=600.0, help="start no request after this many seconds")
    lv.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, seconds")
    lv.add_argument("--label", default="live", help="name of this run in the report (e.g. the policy)")
    _output_flags(lv, "live")


def _progress(quiet: bool) -> tuple[Progress | None, replay.ProgressFn | None]:
    if quiet:
        return None, None
    bar = Progress()

    def cb(label: str, done: int, total: int) -> None:
        if label != bar.label:
            bar.close()
            bar.set_label(label)
        bar.update(done, total)

    return bar, cb


def _replay(args: argparse.Namespace) -> int:
    if args.compare == "dynamo" and args.source in GENERATORS:
        print("kvroute bench: --compare dynamo needs a Mooncake trace file", file=sys.stderr)
        return 2
    settings = replay.ReplaySettings(
        source=args.source,
        policies=args.policies,
        loads=args.loads,
        replicas=args.replicas,
        preset=args.preset,
        requests=args.requests,
        num_gpu_blocks=args.gpu_blocks,
        num_cpu_blocks=args.cpu_blocks,
        arrival=args.arrival,
        arrival_rate=args.arrival_rate,
        arrival_trace=args.arrival_trace,
        routers=args.routers,
        fanout_delay_ms=None if args.no_fanout else args.fanout_delay_ms,
        event_delay_ms=args.event_delay_ms,
        capacity_rps=args.capacity,
        params=tuple(args.param),
        seed=args.seed,
        bounds=not args.no_bounds,
    )
    bar, cb = _progress(args.quiet)
    try:
        result = replay.run(settings, cb)
        if args.compare == "dynamo":
            _compare_dynamo(args, settings, result, cb)
    finally:
        if bar is not None:
            bar.close()
    files = report.write(result, args.out, args.name, plots=not args.no_plots)
    if not args.quiet:
        print(report.markdown(result))
    for f in files:
        print(f"wrote {f}", file=sys.stderr)
    return 0


def _compare_dynamo(
    args: argparse.Namespace, s: replay.ReplaySettings, result: dict[str, Any], cb: replay.ProgressFn | None
) -> None:
    """Dynamo's replay (round robin, KV router) and ours (round robin, kvroute) on the
    dynamo-mocker preset, at the same loads of round robin's capacity on that preset."""
    if not args.dynamo_python:
        result["dynamo_error"] = "no Dynamo interpreter (pass --dynamo-python)"
        return
    ours = replay.ReplaySettings(
        **{
            **s.__dict__,
            "preset": "dynamo-mocker",
            "policies": ("round_robin", "kvroute"),
            "routers": (1,),
            "capacity_rps": None,
            "bounds": False,
        }
    )
    mine = replay.run(ours, cb)
    trace_rate = mine["runs"][0]["offered_rps"] / mine["runs"][0]["speedup"]
    speedups = [load * mine["capacity"]["rps"] / trace_rate for load in s.loads]
    try:
        theirs = dynamo.run(
            args.dynamo_python,
            s.source,
            workers=s.replicas,
            speedups=speedups,
            num_gpu_blocks=s.num_gpu_blocks,
        )
    except dynamo.DynamoError as e:
        result["dynamo_error"] = str(e)
        return
    by_speed = dict(zip(speedups, s.loads, strict=True))
    for r in theirs:
        r["load"] = by_speed.get(r["speedup"])
    for r in mine["runs"]:
        r["policy"] = f"kvroute:{r['policy']}"
    rows = sorted(mine["runs"] + theirs, key=lambda r: (r["load"] or 0, r["policy"]))
    result["dynamo"] = rows
    result["dynamo_capacity"] = mine["capacity"]


def _live(args: argparse.Namespace) -> int:
    settings = live.LiveSettings(
        url=args.url,
        source=args.source,
        model=args.model,
        requests=args.requests if args.requests is not None else 200,
        speedup=args.speedup,
        arrival=args.arrival,
        arrival_rate=args.arrival_rate,
        arrival_trace=args.arrival_trace,
        max_tokens=args.max_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        chat=args.chat,
        ignore_eos=not args.no_ignore_eos,
        api_key=args.api_key,
        duration_s=args.duration,
        timeout_s=args.timeout,
        label=args.label,
        seed=args.seed,
    )
    bar, cb = _progress(args.quiet)
    try:
        result = live.run(settings, cb)
    finally:
        if bar is not None:
            bar.close()
    files = report.write(result, args.out, args.name, plots=not args.no_plots)
    if not args.quiet:
        print(report.markdown(result))
    for f in files:
        print(f"wrote {f}", file=sys.stderr)
    return 0 if result["runs"][0]["errors"] < result["runs"][0]["num_requests"] else 1


def run(args: argparse.Namespace) -> int:
    """Runs the parsed ``bench`` command."""
    if args.bench_command == "replay":
        return _replay(args)
    return _live(args)
