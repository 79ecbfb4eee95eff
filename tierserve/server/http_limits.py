"""Limits on what one connection may cost before the application sees a request: `[server.http]`.

Every limit has a default that is safe on a public network; `tierserve serve` flags override
the file. Enforced by `GuardedHttpProtocol` (http_guard.py), below FastAPI.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from tierserve.cli_args import int_at_least, positive_float, positive_int
from tierserve.config import ConfigError

KEYS = (
    "max_header_bytes",
    "max_headers",
    "header_timeout_s",
    "body_timeout_s",
    "send_timeout_s",
    "keep_alive_timeout_s",
    "max_connections",
)


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = 32 * 1024  # request line + headers; past it: 431 and close
    max_headers: int = 100  # header fields per request; past it: 431 and close
    header_timeout_s: float = 10.0  # connection open (or a request's first byte) to end of headers: 408
    body_timeout_s: float = 30.0  # from the end of the headers to the end of the body: 400
    send_timeout_s: float = 60.0  # a reply the client reads none of for this long: closed
    keep_alive_timeout_s: int = 5  # an idle keep-alive connection is closed after this
    max_connections: int = 512  # open connections per server; one more is answered 503 and closed


# A request line and the headers any client sends take a few hundred bytes: a server with
# less answered 431 to every request, /ready included.
MIN_HEADER_BYTES = 1024


def _value(path: str, value: Any, *, integer: bool, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if integer and not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{path}: must be a finite number > 0, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path}: must be at least {minimum:g}, got {value!r}")
    return float(value)


def parse_http_limits(raw: Mapping[str, Any], base: HttpLimits | None = None) -> HttpLimits:
    """Validate `[server.http]` (or CLI overrides, with `base` the file's values)."""
    base = base or HttpLimits()
    for key in raw:
        if key not in KEYS:
            raise ConfigError(f"server.http.{key}: unknown key (known: {', '.join(sorted(KEYS))})")

    def get(key: str, integer: bool, minimum: float = 0.0) -> float:
        value = raw.get(key)
        if value is None:
            return float(getattr(base, key))
        return _value(f"server.http.{key}", value, integer=integer, minimum=minimum)

    return HttpLimits(
        max_header_bytes=int(get("max_header_bytes", True, MIN_HEADER_BYTES)),
        max_headers=int(get("max_headers", True)),
        header_timeout_s=get("header_timeout_s", False),
        body_timeout_s=get("body_timeout_s", False),
        send_timeout_s=get("send_timeout_s", False),
        keep_alive_timeout_s=int(get("keep_alive_timeout_s", True)),
        max_connections=int(get("max_connections", True)),
    )


# (flag, key, type, help): `tierserve serve` flags that override `[server.http]`. Each type
# refuses what `parse_http_limits` refuses, so that the error names the flag, not the key.
FLAGS: tuple[tuple[str, str, Callable[[str], float], str], ...] = (
    (
        "--max-header-bytes",
        "max_header_bytes",
        int_at_least(MIN_HEADER_BYTES),
        "largest request line + headers; past it 431",
    ),
    ("--max-headers", "max_headers", positive_int, "most header fields per request; past it 431"),
    ("--header-timeout", "header_timeout_s", positive_float, "seconds to send a request's headers; then 408"),
    (
        "--body-timeout",
        "body_timeout_s",
        positive_float,
        "seconds to send a body after its headers; then 400",
    ),
    (
        "--send-timeout",
        "send_timeout_s",
        positive_float,
        "seconds a reply may wait on a client that reads none of it; then closed",
    ),
    (
        "--keep-alive-timeout",
        "keep_alive_timeout_s",
        positive_int,
        "seconds an idle keep-alive connection stays open",
    ),
    ("--max-connections", "max_connections", positive_int, "open connections per server; past it 503"),
)


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    defaults = HttpLimits()
    for flag, key, kind, text in FLAGS:
        parser.add_argument(
            flag,
            dest=key,
            type=kind,
            default=None,
            help=f"{text} (default: [server.http].{key} or {getattr(defaults, key)})",
        )


def http_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `[server.http]` keys given on the command line."""
    return {key: getattr(args, key) for _, key, _, _ in FLAGS if getattr(args, key, None) is not None}
