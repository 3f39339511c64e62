"""``GET /status`` (JSON) and the status page ``GET /`` that renders it every two seconds."""

from __future__ import annotations

import time
from importlib import resources
from typing import TYPE_CHECKING, Any

from kvroute import __version__

if TYPE_CHECKING:
    from kvroute.server.app import RouterState


def snapshot(state: RouterState) -> dict[str, Any]:
    """Backends (health, ledger load, engine metrics, index share, events), limits, scheduler
    counters, index size and the most recent routing decisions."""
    f = state.fleet
    backends = f.snapshot()
    total = sum(e["index_entries"] for b in backends for e in b["engines"]) or 1
    for b in backends:
        entries = sum(e["index_entries"] for e in b["engines"])
        b["cache_share"] = round(entries / total, 4)
        b["active"] = sum(e["load"].get("active", 0) for e in b["engines"])
    stats = f.index.stats()
    c = state.config
    return {
        "version": __version__,
        "uptime_s": round(time.time() - state.started, 3),
        "model": list(f.served_models()),
        "max_model_len": f.max_model_len(),
        "policy": f.scheduler.policy,
        "block_size": c.block_size,
        "tokenizer": {
            "backend": state.encoder.backend,
            "path": str(state.encoder.files.tokenizer_json),
            "segment_cache": state.encoder.segment_cache_stats(),
        },
        "limits": {
            "active": state.limiter.active,
            "waiting": state.limiter.waiting,
            "rejected": state.limiter.rejected,
            "max_concurrency": c.max_concurrency,
            "max_queue": c.max_queue,
        },
        "scheduler": {"reservations": f.scheduler.reservations(), "counters": f.scheduler.counters()},
        "index": {
            k: stats[k] for k in ("workers", "blocks", "entries", "memory_bytes", "speculative_blocks")
        },
        "backends": backends,
        "peers": f.peers.snapshot() if f.peers is not None else None,
        "recent_decisions": list(state.proxy.decisions)[-20:][::-1],
    }


PAGE = (resources.files("kvroute.server") / "status.html").read_text(encoding="utf-8")
"""The status page: static HTML that fetches ``status`` every two seconds."""
