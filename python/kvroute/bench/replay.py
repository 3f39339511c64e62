"""``kvroute bench replay``: policies x loads on simulated engines, on virtual time.

Every run goes through the production Rust scheduler and prefix index (``kvroute._native.replay``);
this module only chooses the runs and collects their reports.

**Load.** A load is a fraction of the *capacity*: the request rate round robin sustains on the same
workload, replicas and preset. Capacity is measured by giving round robin every request at once (a
closed backlog, ``arrival="burst"``) and dividing the requests by the time it takes to complete
them: the most the cluster completes per second under that policy. A load of 0.8 then replays the
workload's arrivals (the trace's own, Poisson or Azure inter-arrivals) compressed so that their
mean rate is 0.8 x capacity.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvroute import _native

#: Policies that are the subject of the benchmark (the rest are baselines).
SUBJECT = "kvroute"

ProgressFn = Callable[[str, int, int], None]


@dataclass(frozen=True)
class ReplaySettings:
    """Everything one ``bench replay`` invocation runs (validated by the CLI)."""

    source: str
    policies: tuple[str, ...] = ("kvroute", "round_robin")
    loads: tuple[float, ...] = (0.5, 0.8, 0.95)
    replicas: int = 8
    preset: str = "llama3-8b-h100"
    requests: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int = 0
    arrival: str = "trace"
    arrival_rate: float | None = None
    arrival_trace: str | None = None
    routers: tuple[int, ...] = (1,)
    fanout_delay_ms: float | None = 1.0
    event_delay_ms: float = 5.0
    capacity_rps: float | None = None
    params: tuple[tuple[str, float], ...] = ()
    seed: int = 0
    bounds: bool = True

    def common(self) -> dict[str, Any]:
        """Keyword arguments shared by every ``_native.replay`` call."""
        return {
            "requests": self.requests,
            "replicas": self.replicas,
            "preset": self.preset,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": self.num_cpu_blocks,
            "event_delay_s": self.event_delay_ms / 1000.0,
            "seed": self.seed,
        }


def measure_capacity(s: ReplaySettings, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Round robin's completion rate with every request queued at once (requests per second)."""
    cb = None if progress is None else (lambda d, t: progress("capacity (round robin, burst)", d, t))
    r = _native.replay(s.source, policy="round_robin", arrival="burst", progress=cb, **s.common())
    return {
        "policy": "round_robin",
        "method": "every request queued at t=0; requests completed / time to complete them",
        "rps": r["request_throughput_rps"],
        "duration_s": r["duration_s"],
        "wall_time_s": r["wall_time_s"],
    }


def _plan(s: ReplaySettings) -> Iterator[tuple[int, float, str]]:
    for routers in s.routers:
        for load in s.loads:
            for policy in s.policies:
                yield routers, load, policy


def run(s: ReplaySettings, progress: ProgressFn | None = None) -> dict[str, Any]:
    """Runs the capacity measurement (unless given), the bounds and every (routers, load, policy)."""
    started = time.monotonic()
    capacity: dict[str, Any] = (
        {"policy": "round_robin", "method": "given", "rps": s.capacity_rps}
        if s.capacity_rps
        else measure_capacity(s, progress)
    )
    bounds = None
    if s.bounds:
        bounds = _native.hit_bounds(
            s.source,
            requests=s.requests,
            replicas=s.replicas,
            preset=s.preset,
            num_gpu_blocks=s.num_gpu_blocks,
            seed=s.seed,
        )
    runs = []
    plan = list(_plan(s))
    for i, (routers, load, policy) in enumerate(plan):
        label = f"[{i + 1}/{len(plan)}] {policy} load {load:.0%}" + (
            f" x{routers} routers" if routers > 1 else ""
        )
        cb = None if progress is None else (lambda d, t, label=label: progress(label, d, t))
        fanout = s.fanout_delay_ms / 1000.0 if (routers > 1 and s.fanout_delay_ms is not None) else None
        r = _native.replay(
            s.source,
            policy=policy,
            rate=load * capacity["rps"],
            arrival=s.arrival,
            arrival_rate=s.arrival_rate,
            arrival_trace=s.arrival_trace,
            routers=routers,
            fanout_delay_s=fanout,
            params=list(s.params) if policy == SUBJECT else None,
            progress=cb,
            **s.common(),
        )
        r["load"] = load
        r["fanout_delay_ms"] = None if fanout is None else s.fanout_delay_ms
        if bounds:
            r["hit_vs_bound"] = r["gpu_hit_ratio"] / bounds["pooled_lru"] if bounds["pooled_lru"] else None
        runs.append(r)
    settings = dataclasses.asdict(s)
    settings["params"] = dict(s.params)
    return {
        "kind": "replay",
        "kvroute_version": _native.__version__,
        "settings": settings,
        "capacity": capacity,
        "bounds": bounds,
        "runs": runs,
        "summary": summarise(runs),
        "wall_time_s": time.monotonic() - started,
    }


@dataclass
class _Cell:
    subject: dict[str, Any] | None = None
    baselines: list[dict[str, Any]] = field(default_factory=list)


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (routers, load): kvroute's TTFT over the best baseline's (mean and p99; below 1 is
    better), its hit ratio over the bound, and with several routers what it keeps of one router."""
    cells: dict[tuple[int, float], _Cell] = {}
    for r in runs:
        c = cells.setdefault((r["routers"], r["load"]), _Cell())
        if r["policy"] == SUBJECT:
            c.subject = r
        else:
            c.baselines.append(r)
    out = []
    for (routers, load), c in sorted(cells.items()):
        if c.subject is None:
            continue
        k = c.subject
        row: dict[str, Any] = {"routers": routers, "load": load, "hit_vs_bound": k.get("hit_vs_bound")}
        for metric in ("mean_ttft_ms", "p99_ttft_ms"):
            if c.baselines:
                best = min(c.baselines, key=lambda b: float(b[metric]))
                row[f"{metric}_best_baseline"] = best["policy"]
                row[f"{metric}_ratio"] = k[metric] / best[metric] if best[metric] else None
        one = cells.get((1, load))
        if routers > 1 and one is not None and one.subject is not None:
            base = one.subject
            row["hit_kept"] = k["gpu_hit_ratio"] / base["gpu_hit_ratio"] if base["gpu_hit_ratio"] else None
            # TTFT kept: single-router TTFT over this one (1.0 = as good, below = worse).
            row["mean_ttft_kept"] = base["mean_ttft_ms"] / k["mean_ttft_ms"] if k["mean_ttft_ms"] else None
            row["p99_ttft_kept"] = base["p99_ttft_ms"] / k["p99_ttft_ms"] if k["p99_ttft_ms"] else None
        out.append(row)
    return out
