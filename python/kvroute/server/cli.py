"""``kvroute serve``: flags (and ``KVROUTE_*`` variables, and a config file) -> RouterConfig -> server."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from kvroute.config import FIELDS, ConfigError, RouterConfig

EPILOG = """\
Every flag --NAME also reads KVROUTE_NAME (e.g. KVROUTE_BACKENDS, KVROUTE_API_KEYS=k1,k2) and the
setting NAME of the config file (--config FILE or KVROUTE_CONFIG; TOML or JSON); a flag wins over
its variable, which wins over the file.

backends: URL[;events=tcp://HOST:PORT][;replay=tcp://HOST:PORT|none][;dp=N][;name=NAME], comma-
separated. Endpoints not given are derived: events on kv_events_port_base + (PORT -
backend_port_base), replay on replay_port_base + (PORT - backend_port_base), i.e. 5557/5657 for a
backend on 8000, as for `vllm serve` with the kv-events config in the README and for
`kvroute sim --replicas N` (5557+i/5657+i on 8000+i).
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Adds the ``serve`` subcommand to an argparse subparsers object."""
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible KV-cache-aware router",
        description="Route OpenAI-compatible requests to vLLM backends by KV-cache overlap and load.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="TOML or JSON file of settings")
    for f in FIELDS.values():
        flag = "--" + f.name.replace("_", "-")
        if f.name == "kv_events":
            p.add_argument("--kv-events", dest="kv_events", action="store_true", default=None, help=f.help)
            p.add_argument(
                "--no-kv-events", dest="kv_events", action="store_false", help="publish-less backends"
            )
        elif f.name == "policy_params":
            p.add_argument(
                "--policy-param", dest="policy_params", action="append", metavar=f.metavar, help=f.help
            )
        elif f.name == "api_keys":
            p.add_argument("--api-key", dest="api_keys", action="append", metavar=f.metavar, help=f.help)
        else:
            p.add_argument(flag, dest=f.name, metavar=f.metavar, help=f.help)
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    flags = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    return RouterConfig.load(flags, config_file=args.config)


def run(args: argparse.Namespace) -> int:
    from kvroute import logs
    from kvroute.server.runner import serve

    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"kvroute serve: {e}", file=sys.stderr)
        return 2
    logs.configure(config.log_level, config.log_format)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # uvloop is optional off Linux/macOS
        runner = asyncio.Runner()
    try:
        with runner:
            runner.run(serve(config))
    except OSError as e:
        print(f"kvroute serve: {e}", file=sys.stderr)
        return 1
    return 0
