"""`tierserve serve`: the OpenAI-compatible server.

Import cost stays low: FastAPI, uvicorn and torch are imported inside the functions that run
the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING

from tierserve.cli_args import add_kv_cache_flag, kv_cache_bytes, port, positive_int
from tierserve.scheduling.registry import DEFAULT_POLICY, policy_names
from tierserve.server.http_limits import add_http_flags, http_overrides, parse_http_limits

if TYPE_CHECKING:
    from tierserve.server.config import ServeConfig
    from tierserve.server.state import ServerState


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible API with priority tiers",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /metrics, /health and /ready. "
        "With no --config the server is open (no keys, no rate limits). docs/serving.md describes the API, "
        "the tiers, tenants and keys, and the config file.",
    )
    p.add_argument(
        "--host",
        default=None,
        help="address to listen on; 0.0.0.0 is every interface (default: [server].host, else 127.0.0.1)",
    )
    p.add_argument(
        "--port", type=port, default=None, help="port to listen on (default: [server].port, else 8000)"
    )
    p.add_argument(
        "--backend",
        choices=("torch", "sim"),
        default="torch",
        help="torch: a real model; sim: a time-faithful simulated deployment (default: torch)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="torch: 'demo' or a Hugging Face directory (default demo); sim: a model name such as "
        "llama-3.1-70b, or a Hugging Face directory (default llama-3.1-70b)",
    )
    p.add_argument(
        "--gpu",
        default=None,
        help="sim: the GPU to simulate: a100-80gb, h100-80gb or h200 (default a100-80gb)",
    )
    p.add_argument("--tp", type=positive_int, default=None, help="sim: tensor-parallel GPUs (default 8)")
    p.add_argument("--device", default=None, help="torch: cpu or cuda (default cpu)")
    add_kv_cache_flag(p, applies_to="torch: ")
    p.add_argument(
        "--policy",
        choices=policy_names(),
        default=DEFAULT_POLICY,
        help="scheduling policy (default %(default)s)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a TOML file: tiers, tenants and their API keys, rate limits, engine and server settings "
        "(deploy/example-config.toml is an annotated example; default: none, an open server)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the least severe log lines printed (default: info)",
    )
    add_http_flags(p)
    p.set_defaults(func=run)


def other_backends_flags(args: argparse.Namespace) -> str | None:
    """A flag given for the backend not chosen (it would be ignored without a word)."""
    given = {
        "torch": [("--device", args.device), ("--kv-cache-gib", args.kv_cache_gib)],
        "sim": [("--gpu", args.gpu), ("--tp", args.tp)],
    }
    for backend, flags in given.items():
        if backend != args.backend:
            for flag, value in flags:
                if value is not None:
                    return f"{flag} applies to --backend {backend}, not {args.backend}"
    return None


class _CannotStart(Exception):
    """A refusal before serving: its message is the one line on stderr (exit status 2)."""


def run(args: argparse.Namespace) -> int:
    from tierserve.server.permissive import closed_tiers, log_permissive_settings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config, state, (host, port_number) = _start(args)
    except _CannotStart as e:
        print(f"tierserve serve: {e}", file=sys.stderr)
        return 2
    # Said once the server will start: a start-up error is then its one line on stderr.
    log = logging.getLogger("tierserve.server")
    log_permissive_settings(config, log)
    for line in closed_tiers(config, state.ceiling_blocks):
        log.warning("%s", line)
    return _serve(args, config, state, host, port_number)


def _start(args: argparse.Namespace) -> tuple[ServeConfig, ServerState, tuple[str, int]]:
    """The config, the address and the engine process, each refused in one line
    (`_CannotStart`) before the next is tried: the address before the model loads, which
    may take minutes."""
    from tierserve.config import ConfigError
    from tierserve.server.backends import BackendSpec
    from tierserve.server.config import load_serve_config
    from tierserve.server.engine_client import EngineStartError
    from tierserve.server.listen_check import cannot_listen
    from tierserve.server.state import spawn_state

    ignored = other_backends_flags(args)
    if ignored is not None:
        raise _CannotStart(ignored)
    try:
        config = load_serve_config(args.config)
        http = parse_http_limits(http_overrides(args), config.server.http)
        config = dataclasses.replace(config, server=dataclasses.replace(config.server, http=http))
    except ConfigError as e:
        raise _CannotStart(str(e)) from None
    host = args.host or config.server.host
    port_number = config.server.port if args.port is None else args.port
    problem = cannot_listen(host, port_number, port_hint="make run PORT=...")
    if problem is not None:
        raise _CannotStart(problem)
    backend = BackendSpec(
        args.backend, args.model, args.gpu, args.tp, args.device or "cpu", kv_cache_bytes(args)
    )
    try:  # the engine, and the model, are built in a process of their own
        state = spawn_state(config, backend, policy=args.policy, log_level=args.log_level.upper())
    except EngineStartError as e:
        raise _CannotStart(str(e)) from None
    return config, state, (host, port_number)


def _serve(
    args: argparse.Namespace, config: ServeConfig, state: ServerState, host: str, port_number: int
) -> int:
    """Serve until SIGTERM (drained) or a second signal; the exit status the drain leaves."""
    import uvicorn

    from tierserve.server.app import create_app
    from tierserve.server.drain import DrainingServer
    from tierserve.server.http_guard import uvicorn_options

    uv_config = uvicorn.Config(
        create_app(state, freeze_heap=True),
        host=host,
        port=port_number,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        **uvicorn_options(config.server.http, state.metrics.count_http_error),
    )
    server = DrainingServer(uv_config, state, config.server.drain_timeout_s)
    try:
        server.run()
    finally:
        state.engine.kill()  # only if uvicorn never started it, or never stopped it
    return server.exit_code
