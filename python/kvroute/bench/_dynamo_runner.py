"""Runs NVIDIA Dynamo's mocker trace replay and prints one JSON line per run.

Executed by ``kvroute bench replay --compare dynamo`` with the interpreter that has
``ai-dynamo-runtime`` installed (it imports nothing from kvroute). Argument: one JSON object with
``trace``, ``workers``, ``speedups``, ``modes``, ``engine`` (extra engine args) and ``block_size``.
"""

import json
import sys
import time

from dynamo._core import run_mocker_trace_replay  # type: ignore[import-not-found]

KEYS = {
    "num_requests": "num_requests",
    "mean_ttft_ms": "mean_ttft_ms",
    "median_ttft_ms": "p50_ttft_ms",
    "p90_ttft_ms": "p90_ttft_ms",
    "p99_ttft_ms": "p99_ttft_ms",
    "mean_e2e_latency_ms": "mean_e2e_ms",
    "p99_e2e_latency_ms": "p99_e2e_ms",
    "prefix_cache_reused_ratio": "gpu_hit_ratio",
    "request_throughput_rps": "request_throughput_rps",
    "duration_ms": "duration_ms",
}


def main() -> None:
    args = json.loads(sys.argv[1])
    for speedup in args["speedups"]:
        for mode in args["modes"]:
            started = time.time()
            res = run_mocker_trace_replay(
                [args["trace"]],
                extra_engine_args=args.get("engine") or None,
                num_workers=args["workers"],
                router_mode=mode,
                arrival_speedup_ratio=speedup,
                trace_block_size=args["block_size"],
            )
            summary = res.summary() if callable(res.summary) else res.summary
            row = {ours: summary.get(theirs) for theirs, ours in KEYS.items()}
            row.update(router_mode=mode, speedup=speedup, wall_time_s=time.time() - started)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
