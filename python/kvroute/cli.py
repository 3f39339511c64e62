"""The ``kvroute`` command: ``--version``, ``info``, ``serve`` (the router), ``sim`` and ``bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvroute import DEFAULT_BLOCK_SIZE, MAX_WORKERS, PrefixIndex, __version__
from kvroute.bench import cli as bench_cli
from kvroute.server import cli as serve_cli
from kvroute.sim import cli as sim_cli


def _info() -> int:
    empty = PrefixIndex().stats()
    print(f"kvroute {__version__}")
    print(f"default_block_size: {DEFAULT_BLOCK_SIZE} tokens")
    print(f"max_workers_per_index: {MAX_WORKERS}")
    print(f"empty_index_memory_bytes: {empty['memory_bytes']}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute", description="KV-cache-aware router for vLLM fleets.")
    p.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("info", help="print the version and the index's limits and memory baseline")
    serve_cli.add_parser(sub)
    sim_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    if args.command == "serve":
        return serve_cli.run(args)
    if args.command == "sim":
        return sim_cli.run(args)
    if args.command == "bench":
        return bench_cli.run(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
