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


def _subparser(parser: argparse.ArgumentParser, *names: str | None) -> argparse.ArgumentParser:
    """The parser of the subcommand `names` (e.g. "bench", "fleet") picks, for its own errors."""
    for name in names:
        if name is None:
            break
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # argparse hands a subcommand's unknown flags to the top parser, whose error then pointed
    # at `tierserve --help`; the subcommand's parser says it, pointing at its own help.
    args, extra = parser.parse_known_args(argv)
    if extra:
        _subparser(parser, args.command, getattr(args, "bench", None)).error(
            f"unrecognized arguments: {' '.join(extra)}"
        )
    prog = " ".join(p for p in ("tierserve", args.command, getattr(args, "bench", None)) if p)
    try:
        result: int = args.func(args)
    except KeyboardInterrupt:
        if args.command == "generate":
            print(flush=True)  # end the line of text streamed so far: the message goes below it
        # Every bench writes its results as it ends: interrupted, it wrote none or only some.
        incomplete = args.command == "bench"
        said = "interrupted: its results are missing or incomplete" if incomplete else "interrupted"
        return fail(prog, said, EXIT_INTERRUPTED)
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
