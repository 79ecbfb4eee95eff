"""The `tierserve` command: serve, generate, profile and the benchmarks.

A command that fails prints one line on stderr and exits non-zero: 2 for a bad argument,
file or setting, 1 for anything else. TIERSERVE_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from tierserve.cli_args import EXIT_USAGE, Parser, fail

# Modules that each define `register(subparsers)`; a subcommand sets `func(args) -> int`.
COMMAND_MODULES = (
    "tierserve.bench.overhead",
    "tierserve.bench.reproduce",
    "tierserve.bench.engine_bench",
    "tierserve.bench.serve_bench",
    "tierserve.bench.gateway_bench",
    "tierserve.bench.fleet_bench",
    "tierserve.bench.sim_check",
    "tierserve.bench.sim_speed",
    "tierserve.bench.vllm_bench",
    "tierserve.executors.sim.profile_cli",
    "tierserve.generate",
    "tierserve.server.cli",
    "tierserve.gateway.cli",
)
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
DEBUG_ENV = "TIERSERVE_DEBUG"


def build_parser() -> argparse.ArgumentParser:
    from tierserve import __version__

    parser = Parser(
        prog="tierserve",
        description="Priority-tiered LLM inference: an OpenAI-compatible server, one-prompt "
        "generation, the GPU simulator's predictions and the benchmarks. "
        "`tierserve COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"tierserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser(
        "bench", help="benchmarks", description="Benchmarks; `tierserve bench NAME --help` for each."
    ).add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        target = bench if name.startswith("tierserve.bench.") else sub
        module.register(target)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean a bad argument, file or setting (exit 2), as opposed to a failure."""
    from tierserve.config import ConfigError
    from tierserve.executors.pytorch.hf_config import ModelLoadError
    from tierserve.server.backends import BackendError

    return (ValueError, OSError, ConfigError, BackendError, ModelLoadError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = " ".join(p for p in ("tierserve", args.command, getattr(args, "bench", None)) if p)
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        return fail(prog, "interrupted", EXIT_INTERRUPTED)
    except Exception as e:
        if os.environ.get(DEBUG_ENV):
            raise
        if isinstance(e, OSError) and e.filename is not None and e.strerror:
            return fail(prog, f"{e.filename}: {e.strerror}", EXIT_USAGE)
        if isinstance(e, _user_errors()):
            return fail(prog, str(e) or type(e).__name__, EXIT_USAGE)
        return fail(prog, f"failed: {type(e).__name__}: {e} ({DEBUG_ENV}=1 shows the traceback)", EXIT_FAILED)
    return result


if __name__ == "__main__":
    sys.exit(main())
