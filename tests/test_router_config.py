"""RouterConfig: sources and precedence, backend syntax and endpoint derivation, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.config import BackendSpec, ConfigError, RouterConfig


def test_defaults_need_backends() -> None:
    with pytest.raises(ConfigError, match="no backends"):
        RouterConfig()


def test_sim_mode_defaults() -> None:
    c = RouterConfig(sim=4)
    assert (c.host, c.port, c.served_model, c.policy) == ("127.0.0.1", 8000, "kvroute-sim", "kvroute")
    assert c.backend_specs == ()


def test_backends_and_sim_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="not both"):
        RouterConfig(sim=1, backends=("http://h:8000",))


def test_endpoints_are_derived_from_the_http_port() -> None:
    c = RouterConfig.load({"backends": "http://h1:8000,http://h2:8003/v1"}, environ={})
    assert c.backend_specs == (
        BackendSpec("http://h1:8000", "h1:8000", "tcp://h1:5557", "tcp://h1:5657"),
        BackendSpec("http://h2:8003", "h2:8003", "tcp://h2:5560", "tcp://h2:5660"),
    )


def test_explicit_endpoints_dp_and_name() -> None:
    c = RouterConfig(backends=("http://[::1]:9000;events=tcp://[::1]:7000;replay=none;dp=2;name=a",))
    (b,) = c.backend_specs
    assert (b.url, b.name, b.dp, b.replay) == ("http://[::1]:9000", "a", 2, None)
    assert [b.events_endpoint(r) for r in range(2)] == ["tcp://[::1]:7000", "tcp://[::1]:7001"]


def test_no_kv_events_means_no_endpoints() -> None:
    (b,) = RouterConfig(backends=("http://h:8000",), kv_events=False).backend_specs
    assert (b.events, b.replay) == (None, None)


def test_underivable_port_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cannot derive its events port"):
        RouterConfig(backends=("http://h:80",))


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("ftp://h:1", "url must be http"),
        ("http://h:8000;dp=0", "dp must be"),
        ("http://h:8000;dp=x", "expected an integer"),
        ("http://h:8000;color=red", "unknown keys"),
        ("http://h:8000;events", "expected key=value"),
        ("http://h:8000;events=h:1", "bad events"),
    ],
)
def test_bad_backends(backend: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterConfig(backends=(backend,))


def test_duplicate_backend_names() -> None:
    with pytest.raises(ConfigError, match="unique"):
        RouterConfig(backends=("http://a:8000;name=x", "http://b:8000;name=x"))


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "router.toml"
    f.write_text('backends = ["http://h:8000"]\nport = 1\nmax-retries = 5\n[serve]\nmodel = "m"\n')
    env = {"KVROUTE_PORT": "2", "KVROUTE_CONFIG": str(f), "KVROUTE_API_KEYS": "a, b"}
    c = RouterConfig.load({"port": "3", "model": None}, environ=env)
    assert (c.port, c.max_retries, c.model, c.api_keys) == (3, 5, "m", ("a", "b"))
    assert RouterConfig.load({}, environ=env).port == 2


def test_json_config_file_with_backend_tables(tmp_path: Path) -> None:
    f = tmp_path / "r.json"
    f.write_text(
        json.dumps(
            {"backends": [{"url": "http://h:8001", "replay": "none"}], "policy_params": {"step_s": 0.01}}
        )
    )
    c = RouterConfig.load(config_file=f, environ={})
    assert c.backend_specs[0].events == "tcp://h:5558"
    assert c.backend_specs[0].replay is None
    assert c.policy_params == (("step_s", 0.01),)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        ({"port": "eighty"}, {}, "--port: "),
        ({}, {"KVROUTE_PORT": "x"}, "KVROUTE_PORT: "),
        ({"port": "70000", "sim": "1"}, {}, "port: must be in"),
        ({"policy": "best", "sim": "1"}, {}, "unknown 'best'"),
        ({"policy_params": ["nope=1"], "sim": "1"}, {}, "unknown knob"),
        ({"policy_params": ["step_s"], "sim": "1"}, {}, "NAME=VALUE"),
        ({"kv_events": "maybe", "sim": "1"}, {}, "expected a boolean"),
        ({"log_level": "loud", "sim": "1"}, {}, "log_level"),
        ({"tokenizer": "/nonexistent/tok.json", "sim": "1"}, {}, "does not exist"),
        ({"max_body_bytes": "10", "sim": "1"}, {}, "max_body_bytes"),
        ({"read_timeout_s": "0", "sim": "1"}, {}, "read_timeout_s"),
        ({"bogus": "1"}, {}, "unknown setting"),
    ],
)
def test_bad_settings_name_their_source(flags: dict[str, object], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RouterConfig.load(flags, environ=env)


def test_bad_config_file(tmp_path: Path) -> None:
    f = tmp_path / "r.toml"
    f.write_text("port = [")
    with pytest.raises(ConfigError, match=r"r\.toml"):
        RouterConfig.load(config_file=f, environ={})
    f.write_text("colour = 1")
    with pytest.raises(ConfigError, match="unknown setting 'colour'"):
        RouterConfig.load(config_file=f, environ={})
    with pytest.raises(ConfigError, match="config file"):
        RouterConfig.load(config_file=tmp_path / "missing.toml", environ={})


def test_config_is_frozen() -> None:
    c = RouterConfig(sim=1)
    with pytest.raises(AttributeError):
        c.port = 1  # type: ignore[misc]
    assert c.with_changes(port=0).port == 0
