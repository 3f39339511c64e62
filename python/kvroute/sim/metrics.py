"""Prometheus metrics of one replica, named and labelled as vLLM 0.33 names them.

vLLM labels every series with ``model_name`` and ``engine`` (the engine index, "0" here), renders
counters with a ``_total`` suffix and a ``# TYPE`` line without it, and exposes the cache
configuration as the gauge ``vllm:cache_config_info`` with value 1 and the settings as labels.
The simulator's own counters are named ``kvroute_sim:*``.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping

# vLLM's buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


class Histogram:
    """A cumulative Prometheus histogram."""

    def __init__(self, buckets: Iterable[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class ReplicaStats:
    """Counters kept by the server and engine loop of one replica."""

    def __init__(self) -> None:
        self.finished: Counter[str] = Counter()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.tokenized_requests = 0
        """Requests whose prompt this replica had to template and/or tokenize."""
        self.tokenized_tokens = 0
        self.reused_prompt_requests = 0
        """Chat requests served from ``kv_transfer_params.prompt_token_ids``."""
        self.crashed_requests = 0
        self.restarts = 0
        self.steps = 0
        self.modelled_step_s = 0.0
        self.late_step_s = 0.0
        self.ttft = Histogram(TTFT_BUCKETS)


def _labels(labels: Mapping[str, object]) -> str:
    def esc(v: object) -> str:
        return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in labels.items()) + "}"


def _num(v: float) -> str:
    return repr(float(v))


class _Writer:
    def __init__(self, base: Mapping[str, object]) -> None:
        self.base = dict(base)
        self.lines: list[str] = []

    def header(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **extra: object) -> None:
        self.lines.append(f"{name}{_labels({**self.base, **extra})} {_num(value)}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self.header(name, "gauge", help_text)
        self.sample(name, value)

    def counter(self, name: str, help_text: str, value: float) -> None:
        self.header(name, "counter", help_text)
        self.sample(name + "_total", value)


def render(
    *,
    model: str,
    engine: Mapping[str, float],
    cache_info: Mapping[str, object],
    stats: ReplicaStats,
    handoff: Mapping[str, int] | None = None,
) -> str:
    """The ``/metrics`` text. ``engine`` is ``SimEngine.metrics()``; ``cache_info`` the labels of
    ``vllm:cache_config_info``."""
    w = _Writer({"engine": "0", "model_name": model})
    w.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", engine["running"])
    w.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine["waiting"])
    w.gauge(
        "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine["kv_cache_usage"]
    )
    w.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        engine["prefix_cache_queries"],
    )
    w.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        engine["prefix_cache_hits"],
    )
    w.counter(
        "vllm:num_preemptions", "Cumulative number of preemption from the engine.", engine["preemptions"]
    )
    w.counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
    w.counter("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens)
    w.header("vllm:request_success", "counter", "Count of successfully processed requests.")
    for reason in FINISH_REASONS:
        w.sample("vllm:request_success_total", stats.finished[reason], finished_reason=reason)
    w.header("vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.")
    cumulative = 0
    for bound, count in zip((*stats.ttft.buckets, float("inf")), stats.ttft.counts, strict=True):
        cumulative += count
        le = "+Inf" if bound == float("inf") else repr(bound)
        w.sample("vllm:time_to_first_token_seconds_bucket", cumulative, le=le)
    w.sample("vllm:time_to_first_token_seconds_count", stats.ttft.count)
    w.sample("vllm:time_to_first_token_seconds_sum", stats.ttft.sum)
    w.header("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    w.sample("vllm:cache_config_info", 1, **{k: v for k, v in cache_info.items()})
    w.counter(
        "kvroute_sim:tokenized_requests",
        "Requests whose prompt the simulator templated and/or tokenized.",
        stats.tokenized_requests,
    )
    w.counter(
        "kvroute_sim:tokenized_tokens", "Prompt tokens produced by tokenization.", stats.tokenized_tokens
    )
    w.counter(
        "kvroute_sim:reused_prompt_token_ids_requests",
        "Chat requests that skipped templating via kv_transfer_params.prompt_token_ids.",
        stats.reused_prompt_requests,
    )
    w.counter(
        "kvroute_sim:crashed_requests",
        "Requests cut by an injected crash or restart.",
        stats.crashed_requests,
    )
    w.counter("kvroute_sim:restarts", "Engine restarts (injected).", stats.restarts)
    for name, value in (handoff or {}).items():
        w.counter(
            f"kvroute_sim:handoff_{name}",
            f"Token handoff (kvroute.vllm): {name.replace('_', ' ')} (see kvroute.vllm.StoreStats).",
            value,
        )
    w.counter("kvroute_sim:engine_steps", "Engine steps taken.", stats.steps)
    w.counter(
        "kvroute_sim:modelled_step_seconds",
        "Wall time the steps should take (modelled duration / time scale).",
        stats.modelled_step_s,
    )
    w.counter(
        "kvroute_sim:late_step_seconds",
        "Wall time by which step results came after their modelled deadline (process overload).",
        stats.late_step_s,
    )
    return "\n".join(w.lines) + "\n"
