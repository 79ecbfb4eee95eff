"""Argument types and the parser every `tierserve` command uses, so that a bad argument is
one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line that points at --help (subcommands' parsers
    are made by `add_subparsers`, which builds them with the parent's class), and which takes
    no abbreviated flags: `bench engine --out X` was read as `--output-tokens X`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def one_line(message: str) -> str:
    return " ".join(message.split())


def _bounded_int(low: int, what: str, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    parse.__name__ = what  # argparse names the type in its own messages
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    return _bounded_int(low, f"an integer >= {low}")


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An integer from `low` to `high`: a count past `high` ran for minutes, or filled memory,
    before saying anything."""
    return _bounded_int(low, f"an integer from {low} to {high:,}", high)


positive_int = _bounded_int(1, "an integer >= 1")
non_negative_int = _bounded_int(0, "an integer >= 0")


def out_path(text: str) -> str:
    """A path to write to: an empty one wrote into the current folder (`Path("")` is `.`), or
    nothing at all, by command."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return text


def cpu_threads(text: str) -> int:
    """torch CPU threads: 0 (torch's default) up to this machine's CPUs (100,000 crashed
    torch, 10,000 hung it; past the CPUs more threads only contend)."""
    value = non_negative_int(text)
    most = os.cpu_count() or 1
    if value > most:
        raise argparse.ArgumentTypeError(
            f"expected 0 (torch's default) to {most} (this machine's CPUs), got {value}"
        )
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (nan and inf are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text}")
    return value


def float_between(low: float, high: float) -> Callable[[str], float]:
    """A number from `low` to `high`."""

    what = f"a number from {low:g} to {high:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high:  # nan fails too
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


def device_name(text: str) -> str:
    """`cpu`, `cuda` or `cuda:N` (what the torch executor runs on)."""
    if re.fullmatch(r"cpu|cuda(:\d+)?", text.strip()) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text.strip()


def port(text: str) -> int:
    value = _bounded_int(0, "a port number 0-65535")(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {value}")
    return value


def fail(prog: str, message: str, status: int = EXIT_USAGE) -> int:
    """Print `prog: message` as one line on stderr; return `status` for the command to exit with."""
    print(f"{prog}: {one_line(message)}", file=sys.stderr)
    return status


def add_kv_cache_flag(parser: argparse.ArgumentParser, applies_to: str = "") -> None:
    """`--kv-cache-gib`, the torch executor's K/V cache size (`kv_cache_bytes` reads it);
    `applies_to` starts its help ("torch: " where the command has other backends)."""
    parser.add_argument(
        "--kv-cache-gib",
        type=positive_float,
        default=None,
        help=f"{applies_to}memory for the K/V cache, in GiB (default: 0.25 on a CPU, half the free "
        "memory on CUDA); a request's context is at most what it holds",
    )


def kv_cache_bytes(args: argparse.Namespace) -> int | None:
    """`--kv-cache-gib` in bytes; None where it was not given (the executor's default)."""
    gib: float | None = args.kv_cache_gib
    return None if gib is None else int(gib * (1 << 30))
