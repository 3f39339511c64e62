"""Prometheus metrics of the router (``GET /metrics``), on a registry of its own.

Counted as requests flow: requests by route, status and backend; routing overhead histograms
(tokenize, decide, total: from the request's arrival to the upstream request being sent);
predicted vs actual cached prompt tokens (the index's match vs the engine's
``usage.prompt_tokens_details.cached_tokens``, when it reports it); upstream retries.
Read at scrape time from the live state: per-engine ledger load (active, prefill tokens, KV
blocks), health, index entries, KV-event lag, batches, gaps, replays and resyncs, the scheduler's
counters (decisions, reservation expiries, no-eligible, saturated) and the index's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from kvroute.fleet import Fleet
    from kvroute.peers import PeerFanout

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_OVERHEAD_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        f = self.fleet
        loads = f.scheduler.loads()
        labels = ["backend", "rank"]
        g = {
            name: GaugeMetricFamily(f"kvroute_backend_{name}", doc, labels=labels)
            for name, doc in (
                ("active_requests", "Requests this router has in flight on the engine (ledger)"),
                ("prefill_tokens", "Prompt tokens booked on the engine and not yet prefilled (ledger)"),
                ("kv_blocks", "KV blocks held by this router's requests on the engine (ledger)"),
                ("decoding_requests", "Requests decoding on the engine (ledger)"),
                ("healthy", "1 when the engine can be selected"),
                ("index_entries", "Index entries (blocks, any tier, speculative included) of the engine"),
                ("index_gpu_blocks", "Blocks the index places in the engine's GPU memory"),
                ("index_cpu_blocks", "Blocks the index places in the engine's CPU offload tier"),
                (
                    "index_speculative_blocks",
                    "Blocks routed to the engine and not yet confirmed by its events",
                ),
                (
                    "kv_event_lag_seconds",
                    "Time from the engine stamping its last KV-event batch to its arrival",
                ),
                ("kv_events_connected", "1 while the KV-event socket is connected"),
                ("engine_running", "vllm:num_requests_running last polled"),
                ("engine_waiting", "vllm:num_requests_waiting last polled"),
                ("engine_kv_usage", "vllm:kv_cache_usage_perc last polled (0..1)"),
            )
        }
        c = {
            name: CounterMetricFamily(f"kvroute_kv_event_{name}", doc, labels=labels)
            for name, doc in (
                ("batches", "KV-event batches received"),
                ("malformed", "KV-event batches rejected as malformed"),
                ("gaps", "Sequence gaps detected"),
                ("missed_batches", "Batches missing in gaps"),
                ("replays", "Replay requests sent"),
                ("replay_failures", "Replays that failed (timeout, no socket, bad reply)"),
                ("resyncs", "Index resyncs (engine entries cleared)"),
                ("restarts", "Sequence restarts detected"),
            )
        }
        tiers = dict(f.index.tier_entries())
        for b in f.backends.values():
            for e in b.engines:
                lv = [b.name, str(e.rank)]
                gpu, cpu, spec = tiers.get(e.worker, (0, 0, 0))
                g["index_gpu_blocks"].add_metric(lv, gpu)
                g["index_cpu_blocks"].add_metric(lv, cpu)
                g["index_speculative_blocks"].add_metric(lv, spec)
                load = loads.get(e.worker)
                if load is not None:
                    g["active_requests"].add_metric(lv, load["active"])
                    g["prefill_tokens"].add_metric(lv, load["prefill_tokens"])
                    g["kv_blocks"].add_metric(lv, load["kv_blocks"])
                    g["decoding_requests"].add_metric(lv, load["decoding"])
                g["healthy"].add_metric(lv, 1.0 if b.healthy else 0.0)
                g["index_entries"].add_metric(lv, f.index.worker_entries(e.worker))
                ev = e.events
                g["kv_event_lag_seconds"].add_metric(lv, ev.lag_s)
                g["kv_events_connected"].add_metric(lv, 1.0 if ev.connected else 0.0)
                if e.metrics is not None:
                    if e.metrics.running is not None:
                        g["engine_running"].add_metric(lv, e.metrics.running)
                    g["engine_waiting"].add_metric(lv, e.metrics.waiting)
                    g["engine_kv_usage"].add_metric(lv, e.metrics.kv_usage)
                for name, fam in c.items():
                    fam.add_metric(lv, getattr(ev, name))
        yield from g.values()
        yield from c.values()
        counters = f.scheduler.counters()
        for key, doc in (
            ("decisions", "Routing decisions made"),
            ("no_eligible", "Decisions that found no healthy engine"),
            ("saturated", "Decisions refused because every engine was at its in-flight limit"),
            ("released", "Reservations released"),
            ("expired", "Reservations that expired without a release"),
            ("remote_applied", "Peer updates that changed the ledger"),
            ("remote_ignored", "Peer updates ignored (own, duplicate, finished or unknown)"),
            ("hedged", "Decisions hedged against concurrent peer-router decisions"),
            ("paced", "Requests that waited for the next decision window during a burst"),
        ):
            fam = CounterMetricFamily(f"kvroute_scheduler_{key}", doc)
            fam.add_metric([], counters.get(key, 0))
            yield fam
        conc = GaugeMetricFamily(
            "kvroute_scheduler_peer_concurrency",
            "Expected peer-router decisions concurrent with one of this router's",
        )
        conc.add_metric([], f.scheduler.peer_concurrency())
        yield conc
        stats = f.index.stats()
        for key, doc in (
            ("entries", "Resident (block, engine) entries, any tier"),
            ("blocks", "Distinct blocks in the index"),
            ("memory_bytes", "Heap bytes held by the index"),
        ):
            gm = GaugeMetricFamily(f"kvroute_index_{key}", doc)
            gm.add_metric([], float(stats[key]))  # type: ignore[literal-required]
            yield gm
        speculated = CounterMetricFamily(
            "kvroute_index_speculated_blocks", "Blocks recorded speculatively at routing time"
        )
        speculated.add_metric([], stats["speculative_blocks"])
        yield speculated
        handoff = CounterMetricFamily(
            "kvroute_token_handoff",
            "Requests by token-handoff result: sent, would_block (channel full or not connected), "
            "no_channel (the engine announced none), skipped (prompt not eligible)",
            labels=["backend", "result"],
        )
        for (backend, result), n in sorted(f.handoff.counts.items()):
            handoff.add_metric([backend, result], n)
        yield handoff
        if f.peers is not None:
            yield from _peer_metrics(f.peers)
        res = GaugeMetricFamily("kvroute_reservations", "Reservations in the ledger")
        res.add_metric([], f.scheduler.reservations())
        yield res


def _peer_metrics(peers: PeerFanout) -> Iterator[Metric]:
    links = peers.links.links
    up = GaugeMetricFamily("kvroute_peer_up", "1 while batches to the peer go out", labels=["peer"])
    sent = CounterMetricFamily("kvroute_peer_sent_batches", "Batches sent to the peer", labels=["peer"])
    dropped = CounterMetricFamily(
        "kvroute_peer_dropped_batches",
        "Batches dropped because the peer was unreachable or too slow",
        labels=["peer"],
    )
    for endpoint, link in links.items():
        up.add_metric([endpoint], 1.0 if link.up else 0.0)
        sent.add_metric([endpoint], link.sent)
        dropped.add_metric([endpoint], link.dropped)
    yield from (up, sent, dropped)
    received = CounterMetricFamily(
        "kvroute_peer_received_batches",
        "Peer batches received, by result (applied, own, duplicate, malformed, auth_failed, stale)",
        labels=["result"],
    )
    for result, n in peers.remote.results.items():
        received.add_metric([result], n)
    yield received
    latency = GaugeMetricFamily(
        "kvroute_peer_batch_latency_seconds",
        "Fan-out latency of the last 1,024 peer update batches (send to arrival), by quantile",
        labels=["quantile"],
    )
    for q, v in peers.remote.latency_quantiles().items():
        latency.add_metric([q], v)
    yield latency
    live = GaugeMetricFamily(
        "kvroute_peer_remote_reservations", "Reservations held for each peer router", labels=["origin"]
    )
    for origin, n in peers.remote.live_by_origin().items():
        live.add_metric([origin], n)
    yield live
    for name, doc, value in (
        ("kvroute_peer_timeouts", "Peer routers dropped after falling silent", peers.remote.timeouts),
        (
            "kvroute_peer_unknown_engines",
            "Peer records naming an engine unknown here",
            peers.remote.unknown_engines,
        ),
    ):
        fam = CounterMetricFamily(name, doc)
        fam.add_metric([], value)
        yield fam


class Metrics:
    """The router's metric objects. One per server."""

    def __init__(self, fleet: Fleet) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvroute_requests", "Client requests answered", ["route", "status", "backend"], registry=r
        )
        self.overhead = Histogram(
            "kvroute_routing_overhead_seconds",
            "Router time per request by stage (tokenize, decide, total before the upstream send)",
            ["stage"],
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.tokenize = self.overhead.labels("tokenize")
        self.decide = self.overhead.labels("decide")
        self.total = self.overhead.labels("total")
        self.prompt_tokens = Counter("kvroute_prompt_tokens", "Prompt tokens routed", ["backend"], registry=r)
        self.predicted_cached = Counter(
            "kvroute_predicted_cached_tokens",
            "Prompt tokens the index predicted cached on the chosen engine (GPU + CPU), for requests "
            "whose engine reported cached_tokens",
            ["backend"],
            registry=r,
        )
        self.actual_cached = Counter(
            "kvroute_actual_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens reported by the engines",
            ["backend"],
            registry=r,
        )
        self.cache_reports = Counter(
            "kvroute_cached_tokens_reports", "Responses that reported cached_tokens", ["backend"], registry=r
        )
        self.retries = Counter(
            "kvroute_upstream_retries",
            "Requests re-routed after a backend failed",
            ["backend", "reason"],
            registry=r,
        )
        self.untokenized = Counter(
            "kvroute_inexact_prompts",
            "Requests routed on approximate token ids (non-text parts...)",
            registry=r,
        )
        self.stream_errors = Counter(
            "kvroute_stream_errors", "Streams ended early by an upstream failure", ["backend"], registry=r
        )
        self.disconnects = Counter("kvroute_client_disconnects", "Clients gone before the end", registry=r)
        r.register(_FleetCollector(fleet))

    def render(self) -> bytes:
        return generate_latest(self.registry)
