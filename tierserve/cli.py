"""The `tierserve` command. Each subcommand lives beside the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that each define `register(subparsers)`; a subcommand sets `func(args) -> int`.
COMMAND_MODULES = (
    "tierserve.bench.overhead",
    "tierserve.bench.reproduce",
    "tierserve.bench.engine_bench",
    "tierserve.bench.serve_bench",
    "tierserve.bench.gateway_bench",
    "tierserve.bench.fleet_bench",
    "tierserve.bench.sim_check",
    "tierserve.executors.sim.profile_cli",
    "tierserve.generate",
    "tierserve.server.cli",
    "tierserve.gateway.cli",
)


def build_parser() -> argparse.ArgumentParser:
    from tierserve import __version__

    parser = argparse.ArgumentParser(prog="tierserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tierserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        target = bench if name.startswith("tierserve.bench.") else sub
        module.register(target)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
