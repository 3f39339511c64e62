"""The router's configuration: one frozen, validated :class:`RouterConfig`.

Every knob is a field of :class:`RouterConfig` and can be set, in increasing order of precedence,
by its default, a config file (TOML or JSON: ``--config PATH`` or ``KVROUTE_CONFIG``), an
environment variable ``KVROUTE_<FIELD>`` and a command-line flag ``--<field-with-dashes>``. The
flag table :data:`FIELDS` drives all four, so they cannot drift apart. Errors name where the bad
value came from (``--port``, ``KVROUTE_PORT``, ``router.toml: port``).

Backends
--------
``--backends`` takes a comma-separated list, ``KVROUTE_BACKENDS`` the same, a config file a list
of strings or tables. Each backend is ``URL[;key=value...]`` with keys

* ``events``: the KV-event ZMQ PUB endpoint of data-parallel rank 0 (``none`` = no events);
* ``replay``: its replay ROUTER endpoint (``none`` = no replay);
* ``dp``: data-parallel ranks behind this URL (default 1); rank ``r`` publishes on the events
  and replay ports plus ``r``, as vLLM does, and requests are pinned with ``X-data-parallel-rank``;
* ``name``: a label for logs, metrics and the status page (default: the URL's ``host:port``).

Endpoints not given are derived (the documented convention, which is also ``kvroute sim``'s):
a backend on HTTP port ``P`` publishes events on ``tcp://HOST:(kv_events_port_base + P -
backend_port_base)`` and answers replays on ``tcp://HOST:(replay_port_base + P -
backend_port_base)``: with the defaults (8000, 5557, 5657) that is vLLM's documented 5557/5657 for
a replica on port 8000, and ports 5557+i/5657+i for ``kvroute sim --replicas N`` on 8000+i.
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvroute._native import POLICIES, POLICY_PARAMS

ENV_PREFIX = "KVROUTE_"
DEFAULT_SIM_MODEL = "kvroute-sim"


class ConfigError(ValueError):
    """A router setting is invalid; the message names the setting and where it came from."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """One vLLM server (all its data-parallel ranks) and where its KV events come from."""

    url: str
    """Base URL without ``/v1``, e.g. ``http://10.0.0.5:8000``."""
    name: str
    events: str | None = None
    """ZMQ PUB endpoint of rank 0 (None: no KV events; routing uses speculation only)."""
    replay: str | None = None
    """ZMQ ROUTER replay endpoint of rank 0 (None: gaps resync the index instead)."""
    dp: int = 1

    def events_endpoint(self, rank: int) -> str | None:
        return _shift_port(self.events, rank)

    def replay_endpoint(self, rank: int) -> str | None:
        return _shift_port(self.replay, rank)


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """Another router replica: where its fan-out socket listens, and its CURVE public key."""

    endpoint: str
    key: str | None = None


Z85_KEY_CHARS = 40


def _is_z85_key(key: str) -> bool:
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
    return len(key) == Z85_KEY_CHARS and all(ch in alphabet for ch in key)


def _check_endpoint(endpoint: str, what: str) -> None:
    ok = endpoint.startswith(("tcp://", "ipc://", "inproc://"))
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[6:].rpartition(":")
        ok = bool(sep and host) and (port == "*" or (port.isdigit() and 0 < int(port) < 65536))
    if not ok:
        raise ConfigError(f"{what}: expected tcp://HOST:PORT, got {endpoint!r}")


def parse_peer(entry: str) -> PeerSpec:
    """``tcp://HOST:PORT[;key=Z85_PUBLIC_KEY]`` (the key: the peer's CURVE public key)."""
    head, *opts = entry.strip().split(";")
    endpoint = head.strip()
    _check_endpoint(endpoint, f"peer {entry!r}")
    key = None
    for opt in opts:
        k, sep, v = opt.partition("=")
        if not sep or k.strip() != "key":
            raise ConfigError(f"peer {entry!r}: expected ;key=CURVE_PUBLIC_KEY, got {opt!r}")
        key = v.strip()
        if not _is_z85_key(key):
            raise ConfigError(f"peer {entry!r}: a CURVE key is 40 Z85 characters")
    return PeerSpec(endpoint, key)


def read_peers_file(path: str | Path) -> tuple[PeerSpec, ...]:
    """Peers listed in a file, one ``tcp://HOST:PORT[;key=...]`` a line; blank lines and lines
    starting with ``#`` are skipped (``#`` can occur in a Z85 key, so there are no end comments)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"peers_file {path}: {e.strerror or e}") from None
    lines = (line.strip() for line in text.splitlines())
    return tuple(parse_peer(line) for line in lines if line and not line.startswith("#"))


def _shift_port(endpoint: str | None, offset: int) -> str | None:
    if endpoint is None or offset == 0:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + offset}"


def _split_list(raw: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in raw.split(",") if s.strip())


def _to_bool(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(raw, str) and raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {raw!r}")


def _to_int(raw: object) -> int:
    if isinstance(raw, bool):
        raise ValueError(f"expected an integer, got {raw!r}")
    if isinstance(raw, int):
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {raw!r}")


def _to_float(raw: object) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"expected a number, got {raw!r}")
    if isinstance(raw, int | float):
        return float(raw)
    if isinstance(raw, str):
        try:
            return float(raw.strip())
        except ValueError:
            pass
    raise ValueError(f"expected a number, got {raw!r}")


def _to_str(raw: object) -> str:
    if isinstance(raw, str):
        return raw
    raise ValueError(f"expected a string, got {raw!r}")


def _optional(conv: Callable[[object], Any]) -> Callable[[object], Any]:
    def parse(raw: object) -> Any:
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in ("", "none")):
            return None
        return conv(raw)

    return parse


def _to_str_tuple(raw: object) -> tuple[str, ...]:
    if isinstance(raw, str):
        return _split_list(raw)
    if isinstance(raw, list | tuple) and all(isinstance(x, str) for x in raw):
        return tuple(raw)
    raise ValueError(f"expected a list of strings, got {raw!r}")


def _to_params(raw: object) -> tuple[tuple[str, float], ...]:
    """``"k=v,k=v"``, a list of ``"k=v"`` or a table ``{k = v}``."""
    if isinstance(raw, Mapping):
        items = [(str(k), v) for k, v in raw.items()]
    else:
        items = []
        for s in _to_str_tuple(raw):
            k, sep, v = s.partition("=")
            if not sep:
                raise ValueError(f"expected NAME=VALUE, got {s!r}")
            items.append((k.strip(), v))
    return tuple((k, _to_float(v)) for k, v in items)


def _to_backends(raw: object) -> tuple[Any, ...]:
    """Raw backend entries: ``"URL;k=v"`` strings or tables; resolved in :func:`resolve_backends`."""
    if isinstance(raw, str):
        return _split_list(raw)
    if isinstance(raw, list | tuple):
        for item in raw:
            if not isinstance(item, str | Mapping):
                raise ValueError(f"each backend must be a string or a table, got {item!r}")
        return tuple(dict(x) if isinstance(x, Mapping) else x for x in raw)
    raise ValueError(f"expected a list of backends, got {raw!r}")


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    conv: Callable[[object], Any]
    help: str
    metavar: str | None = None
    flag_action: str | None = None
    """argparse action for flags that differ from ``--name VALUE`` (``store_true``, ``append``)."""


_FIELDS: tuple[Field, ...] = (
    Field("host", _to_str, "address to listen on (default 127.0.0.1)"),
    Field("port", _to_int, "port to listen on (default 8000)"),
    Field("backends", _to_backends, "comma-separated backends, URL[;events=EP][;replay=EP][;dp=N]"),
    Field("sim", _to_int, "start N simulated vLLM engines in this process and route to them"),
    Field("sim_time_scale", _to_float, "--sim engines run this many times faster than real time"),
    Field("sim_preset", _optional(_to_str), "engine preset of the --sim engines"),
    Field("model", _optional(_to_str), "served model name clients must ask for (--sim: kvroute-sim)"),
    Field("tokenizer", _optional(_to_str), "tokenizer.json or a folder holding it (default: DeepSeek's)"),
    Field("chat_template", _optional(_to_str), "Jinja2 chat template file (default: the tokenizer folder's)"),
    Field("tokenizer_backend", _to_str, "auto (fastokens if it matches HF tokenizers), fastokens or hf"),
    Field("policy", _to_str, f"routing policy: {', '.join(POLICIES)}"),
    Field("policy_params", _to_params, "policy knob NAME=VALUE (repeatable)", "NAME=VALUE", "append"),
    Field("block_size", _to_int, "KV block size of the engines, tokens (default 16)"),
    Field("max_inflight_per_worker", _to_int, "in-flight requests per engine before 429 (0 = no limit)"),
    Field("reservation_ttl_s", _to_float, "a reservation never released expires after this"),
    Field("speculative_ttl_s", _to_float, "routed prefixes count as cached this long before events"),
    Field("index_max_entries", _to_int, "prefix-index budget in (block, engine) entries (0 = unbounded)"),
    Field("seed", _to_int, "seed of the policy's tie-breaking"),
    Field("default_max_tokens", _to_int, "expected output tokens of a request without max_tokens"),
    Field("max_model_len", _optional(_to_int), "context length (default: learned from /v1/models)"),
    Field("max_body_bytes", _to_int, "largest request body accepted (413 above)"),
    Field("max_concurrency", _to_int, "requests proxied at once (0 = no limit)"),
    Field("max_queue", _to_int, "requests waiting for a slot beyond max_concurrency before 429"),
    Field("queue_timeout_s", _to_float, "longest wait for a slot before 429"),
    Field("retry_after_s", _to_int, "Retry-After of 429 answers, seconds"),
    Field("max_retries", _to_int, "re-routes of a request whose backend failed before answering"),
    Field("connect_timeout_s", _to_float, "upstream connect timeout"),
    Field("first_byte_timeout_s", _to_float, "upstream time to the first response byte (then re-route)"),
    Field("read_timeout_s", _to_float, "longest upstream silence once a response has started"),
    Field("health_interval_s", _to_float, "seconds between /health polls"),
    Field("health_timeout_s", _to_float, "timeout of one /health or /metrics poll"),
    Field("unhealthy_after", _to_int, "consecutive failed polls that mark a backend unhealthy"),
    Field("metrics_interval_s", _to_float, "seconds between /metrics polls (0 = never)"),
    Field("kv_events", _to_bool, "subscribe to backends' KV events (--no-kv-events: speculation only)"),
    Field("backend_port_base", _to_int, "HTTP port that maps to kv_events_port_base (derivation)"),
    Field("kv_events_port_base", _to_int, "KV-event port of a backend on backend_port_base"),
    Field("replay_port_base", _optional(_to_int), "replay port of a backend on backend_port_base"),
    Field("events_topic", _to_str, "ZMQ topic to subscribe to (vLLM's default is empty)"),
    Field("replay_timeout_s", _to_float, "timeout of one replay request"),
    Field("api_keys", _to_str_tuple, "accepted client API key (repeatable; none = open)", "KEY", "append"),
    Field("admin_key", _optional(_to_str), "API key of the /admin routes (unset = admin disabled)"),
    Field("backend_api_key", _optional(_to_str), "Bearer token sent to the backends"),
    Field(
        "router_name", _optional(_to_str), "this router's name in peer messages and logs (default host:port)"
    ),
    Field("peers", _to_str_tuple, "peer routers' fan-out endpoints, tcp://HOST:PORT[;key=CURVE_PUBLIC_KEY]"),
    Field(
        "peers_file", _optional(_to_str), "file listing peer endpoints, one a line (re-read when it changes)"
    ),
    Field(
        "peer_bind", _optional(_to_str), "where to receive peers' fan-out (tcp://HOST:PORT; unset = no bind)"
    ),
    Field("peer_secret", _optional(_to_str), "shared secret authenticating peer batches (HMAC-SHA256)"),
    Field(
        "peer_curve_secret_key", _optional(_to_str), "this router's ZMQ CURVE secret key (Z85): encrypt peers"
    ),
    Field("peer_snapshot_interval_s", _to_float, "seconds between full ledger snapshots sent to peers"),
    Field("peer_timeout_s", _to_float, "a peer silent this long has its reservations dropped"),
    Field("peer_hwm", _to_int, "batches queued per peer before its backlog is dropped"),
    Field("peer_max_skew_s", _to_float, "with a secret: batches stamped further from now are refused"),
    Field("token_handoff", _to_str, "hand token ids to engines running kvroute.vllm: auto, on or off"),
    Field("handoff_hwm", _to_int, "token-handoff messages queued per engine before sends are skipped"),
    Field("handoff_min_tokens", _to_int, "prompts shorter than this are not handed off"),
    Field("recent_decisions", _to_int, "routing decisions kept for the status page"),
    Field("log_level", _to_str, "critical, error, warning, info or debug (score breakdowns)"),
    Field("log_format", _to_str, "text or json (one object per line)"),
)
FIELDS: Mapping[str, Field] = {f.name: f for f in _FIELDS}

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Everything ``kvroute serve`` runs with. Validated on construction; never mutated."""

    host: str = "127.0.0.1"
    port: int = 8000
    backends: tuple[Any, ...] = ()
    """Resolved :class:`BackendSpec` objects after :meth:`load` (raw entries are resolved too)."""
    sim: int = 0
    sim_time_scale: float = 1.0
    sim_preset: str | None = None
    model: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    tokenizer_backend: str = "auto"
    policy: str = "kvroute"
    policy_params: tuple[tuple[str, float], ...] = ()
    block_size: int = 16
    max_inflight_per_worker: int = 0
    reservation_ttl_s: float = 600.0
    speculative_ttl_s: float = 5.0
    index_max_entries: int = 0
    seed: int = 0
    default_max_tokens: int = 256
    max_model_len: int | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    max_concurrency: int = 0
    max_queue: int = 0
    queue_timeout_s: float = 30.0
    retry_after_s: int = 1
    max_retries: int = 2
    connect_timeout_s: float = 3.0
    first_byte_timeout_s: float = 60.0
    read_timeout_s: float = 300.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2
    metrics_interval_s: float = 1.0
    kv_events: bool = True
    backend_port_base: int = 8000
    kv_events_port_base: int = 5557
    replay_port_base: int | None = 5657
    events_topic: str = ""
    replay_timeout_s: float = 2.0
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None
    backend_api_key: str | None = None
    router_name: str | None = None
    peers: tuple[str, ...] = ()
    peers_file: str | None = None
    peer_bind: str | None = None
    peer_secret: str | None = field(default=None, repr=False)
    peer_curve_secret_key: str | None = field(default=None, repr=False)
    peer_snapshot_interval_s: float = 1.0
    peer_timeout_s: float = 10.0
    peer_hwm: int = 1000
    peer_max_skew_s: float = 30.0
    token_handoff: str = "auto"
    handoff_hwm: int = 1000
    handoff_min_tokens: int = 0
    recent_decisions: int = 100
    log_level: str = "info"
    log_format: str = "text"
    backend_specs: tuple[BackendSpec, ...] = field(default=(), repr=False)
    """The backends, resolved (filled in by ``__post_init__``)."""
    peer_specs: tuple[PeerSpec, ...] = field(default=(), repr=False)
    """``peers``, parsed (filled in by ``__post_init__``)."""

    def __post_init__(self) -> None:
        _validate(self)
        object.__setattr__(self, "peer_specs", tuple(parse_peer(p) for p in self.peers))
        _validate_peers(self)
        object.__setattr__(self, "backend_specs", resolve_backends(self, self.backends))
        names = [b.name for b in self.backend_specs]
        _check(len(set(names)) == len(names), f"backends: names must be unique, got {names}")

    @property
    def fanout(self) -> bool:
        """Whether this router takes part in peer fan-out."""
        return bool(self.peers or self.peers_file or self.peer_bind)

    @property
    def served_model(self) -> str | None:
        """The model name clients must ask for (None: any name the backends serve)."""
        if self.model is None and self.sim:
            return DEFAULT_SIM_MODEL
        return self.model

    def with_changes(self, **changes: Any) -> RouterConfig:
        return replace(self, **changes)

    @classmethod
    def load(
        cls,
        flags: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
        config_file: str | Path | None = None,
    ) -> RouterConfig:
        """Defaults < config file < ``KVROUTE_*`` variables < ``flags`` (None values ignored)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = config_file if config_file is not None else env.get(ENV_PREFIX + "CONFIG") or None
        if path is not None:
            values.update(read_config_file(Path(path)))
        for f in _FIELDS:
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = _convert(f, raw, f"{ENV_PREFIX}{f.name.upper()}")
        for name, raw in (flags or {}).items():
            if raw is None:
                continue
            spec = FIELDS.get(name)
            if spec is None:
                raise ConfigError(f"unknown setting {name!r}")
            values[name] = _convert(spec, raw, "--" + name.replace("_", "-"))
        return cls(**values)


def _convert(f: Field, raw: object, where: str) -> Any:
    try:
        return f.conv(raw)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """A TOML (``.toml``) or JSON file of settings (``-`` and ``_`` in keys are equivalent).
    TOML settings may sit at the top level or in a ``[serve]`` table."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    try:
        data: object = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table of settings")
    if isinstance(data.get("serve"), dict):
        data = {**{k: v for k, v in data.items() if k != "serve"}, **data["serve"]}
    out: dict[str, Any] = {}
    for key, raw in data.items():
        name = key.replace("-", "_")
        f = FIELDS.get(name)
        if f is None:
            raise ConfigError(f"config file {path}: unknown setting {key!r}")
        out[name] = _convert(f, raw, f"{path.name}: {key}")
    return out


def resolve_backends(c: RouterConfig, entries: Sequence[Any]) -> tuple[BackendSpec, ...]:
    """Parses backend entries and derives the endpoints not given (see the module docstring)."""
    return tuple(parse_backend(c, e) for e in entries)


_BACKEND_KEYS = frozenset({"url", "events", "replay", "dp", "name"})


def parse_backend(c: RouterConfig, entry: Any) -> BackendSpec:
    """One backend from ``"URL[;key=value...]"``, a table or a :class:`BackendSpec`."""
    if isinstance(entry, BackendSpec):
        return entry
    if isinstance(entry, str):
        head, *opts = entry.split(";")
        table: dict[str, Any] = {"url": head.strip()}
        for opt in opts:
            k, sep, v = opt.partition("=")
            if not sep:
                raise ConfigError(f"backend {entry!r}: expected key=value after ';', got {opt!r}")
            table[k.strip()] = v.strip()
    elif isinstance(entry, Mapping):
        table = dict(entry)
    else:
        raise ConfigError(f"backend {entry!r}: expected a string or a table")
    unknown = set(table) - _BACKEND_KEYS
    if unknown:
        raise ConfigError(
            f"backend {entry!r}: unknown keys {sorted(unknown)} (known: {sorted(_BACKEND_KEYS)})"
        )
    url = str(table.get("url", "")).rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"backend {entry!r}: url must be http(s)://HOST[:PORT], got {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        dp = _to_int(table.get("dp", 1))
    except ValueError as e:
        raise ConfigError(f"backend {entry!r}: {e}") from None
    _check(1 <= dp <= 1024, f"backend {entry!r}: dp must be in 1..1024, got {dp}")
    host = parts.hostname
    zhost = f"[{host}]" if ":" in host else host

    def endpoint(key: str, base: int | None) -> str | None:
        if key in table:
            v = str(table[key]).strip()
            if v.lower() in ("", "none", "off"):
                return None
            _check(v.startswith(("tcp://", "ipc://", "inproc://")), f"backend {entry!r}: bad {key} {v!r}")
            _check(":" in v[6:], f"backend {entry!r}: {key} endpoint needs a port")
            return v
        if not c.kv_events or base is None:
            return None
        derived = base + port - c.backend_port_base
        if not 1 <= derived <= 65535 - dp + 1:
            raise ConfigError(
                f"backend {entry!r}: cannot derive its {key} port from HTTP port {port} "
                f"(base {c.backend_port_base}); give {key}=tcp://HOST:PORT or {key}=none"
            )
        return f"tcp://{zhost}:{derived}"

    events = endpoint("events", c.kv_events_port_base) if c.kv_events else None
    replay = endpoint("replay", c.replay_port_base) if events is not None else None
    name = str(table.get("name") or f"{host}:{port}")
    return BackendSpec(url=url, name=name, events=events, replay=replay, dp=dp)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_peers(c: RouterConfig) -> None:
    if c.peer_bind is not None:
        _check_endpoint(c.peer_bind, "peer_bind")
    if c.peers_file is not None:
        read_peers_file(c.peers_file)  # readable and well-formed now; re-read while running
    _check(c.router_name is None or bool(c.router_name.strip()), "router_name: must not be empty")
    _check(c.peer_secret is None or len(c.peer_secret) >= 16, "peer_secret: use at least 16 characters")
    key = c.peer_curve_secret_key
    if key is not None:
        _check(_is_z85_key(key), "peer_curve_secret_key: a CURVE key is 40 Z85 characters")
        for p in c.peer_specs:
            _check(p.key is not None, f"peers: {p.endpoint} needs ;key=PUBLIC_KEY with CURVE on")
    else:
        for p in c.peer_specs:
            _check(p.key is None, f"peers: {p.endpoint} has a key but peer_curve_secret_key is unset")
    for name in ("peer_snapshot_interval_s", "peer_timeout_s", "peer_max_skew_s"):
        v = getattr(c, name)
        _check(math.isfinite(v) and v > 0, f"{name}: must be > 0, got {v}")
    _check(
        c.peer_timeout_s > c.peer_snapshot_interval_s,
        "peer_timeout_s: must be longer than peer_snapshot_interval_s (snapshots are the heartbeat)",
    )
    _check(c.peer_hwm >= 1, f"peer_hwm: must be >= 1, got {c.peer_hwm}")


def _validate(c: RouterConfig) -> None:
    _check(bool(c.host.strip()), "host: must not be empty")
    _check(0 <= c.port <= 65535, f"port: must be in 0..65535, got {c.port}")
    _check(0 <= c.sim <= 64, f"sim: must be in 0..64 engines, got {c.sim}")
    _check(not (c.backends and c.sim), "give either backends (--backends URL,...) or --sim N, not both")
    _check(
        bool(c.backends or c.sim or c.admin_key),
        "no backends: give --backends URL[,URL...] or --sim N (or --admin-key to add them at run time)",
    )
    _check(
        math.isfinite(c.sim_time_scale) and c.sim_time_scale > 0,
        f"sim_time_scale: must be > 0, got {c.sim_time_scale}",
    )
    _check(c.model is None or bool(c.model.strip()), "model: must not be empty")
    _check(
        c.tokenizer_backend in ("auto", "fastokens", "hf"),
        f"tokenizer_backend: must be auto, fastokens or hf, got {c.tokenizer_backend!r}",
    )
    for name in ("tokenizer", "chat_template"):
        p = getattr(c, name)
        _check(p is None or Path(p).exists(), f"{name}: {p} does not exist")
    _check(c.policy in POLICIES, f"policy: unknown {c.policy!r} (one of {', '.join(POLICIES)})")
    for k, v in c.policy_params:
        _check(k in POLICY_PARAMS, f"policy_params: unknown knob {k!r} (one of {', '.join(POLICY_PARAMS)})")
        _check(math.isfinite(v), f"policy_params: {k} must be finite")
    _check(1 <= c.block_size <= 4096, f"block_size: must be in 1..4096, got {c.block_size}")
    for name in ("max_inflight_per_worker", "index_max_entries", "max_concurrency", "max_queue", "seed"):
        _check(getattr(c, name) >= 0, f"{name}: must be >= 0, got {getattr(c, name)}")
    _check(c.default_max_tokens >= 1, f"default_max_tokens: must be >= 1, got {c.default_max_tokens}")
    _check(c.max_model_len is None or c.max_model_len >= 1, "max_model_len: must be >= 1")
    _check(c.max_body_bytes >= 1024, f"max_body_bytes: must be >= 1024, got {c.max_body_bytes}")
    _check(c.retry_after_s >= 0, "retry_after_s: must be >= 0")
    _check(0 <= c.max_retries <= 16, f"max_retries: must be in 0..16, got {c.max_retries}")
    _check(c.unhealthy_after >= 1, "unhealthy_after: must be >= 1")
    _check(c.recent_decisions >= 0, "recent_decisions: must be >= 0")
    _check(
        c.token_handoff in ("auto", "on", "off"),
        f"token_handoff: must be auto, on or off, got {c.token_handoff!r}",
    )
    _check(c.handoff_hwm >= 1, f"handoff_hwm: must be >= 1, got {c.handoff_hwm}")
    _check(c.handoff_min_tokens >= 0, f"handoff_min_tokens: must be >= 0, got {c.handoff_min_tokens}")
    for name in (
        "reservation_ttl_s",
        "queue_timeout_s",
        "connect_timeout_s",
        "first_byte_timeout_s",
        "read_timeout_s",
        "health_interval_s",
        "health_timeout_s",
        "replay_timeout_s",
    ):
        v = getattr(c, name)
        _check(math.isfinite(v) and v > 0, f"{name}: must be > 0, got {v}")
    for name in ("speculative_ttl_s", "metrics_interval_s"):
        v = getattr(c, name)
        _check(math.isfinite(v) and v >= 0, f"{name}: must be >= 0, got {v}")
    for name in ("backend_port_base", "kv_events_port_base"):
        _check(1 <= getattr(c, name) <= 65535, f"{name}: must be a port, got {getattr(c, name)}")
    _check(c.replay_port_base is None or 1 <= c.replay_port_base <= 65535, "replay_port_base: bad port")
    _check(all(k.strip() for k in c.api_keys), "api_keys: keys must not be empty")
    _check(c.admin_key is None or bool(c.admin_key.strip()), "admin_key: must not be empty")
    _check(
        c.log_level in LOG_LEVELS, f"log_level: must be one of {', '.join(LOG_LEVELS)}, got {c.log_level!r}"
    )
    _check(c.log_format in ("text", "json"), f"log_format: must be text or json, got {c.log_format!r}")
