"""`tierserve gateway`: the OpenAI-compatible API in front of many engine replicas."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from tierserve.cli_args import port
from tierserve.server.http_limits import add_http_flags, http_overrides, parse_http_limits


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "gateway",
        help="serve the OpenAI-compatible API in front of upstream replicas (vLLM, SGLang, tierserve, "
        "any OpenAI-compatible server)",
        description="Tiers, tenants, global limits in Redis, flow control and tier-aware routing "
        "in front of the [[upstreams]] listed in the config.",
    )
    p.add_argument("--config", required=True, help="TOML: [gateway], [[upstreams]] and the server's sections")
    p.add_argument("--host", default=None, help="bind address (default: [server].host, else 127.0.0.1)")
    p.add_argument("--port", type=port, default=None, help="port (default: [server].port, else 8000)")
    add_http_flags(p)
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the least severe log lines printed (default: info)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tierserve.config import ConfigError
    from tierserve.gateway.app import create_gateway_app
    from tierserve.gateway.config import (
        load_gateway_config,
        redis_fail_summary,
        waits_shorter_than_the_queues_way_out,
    )
    from tierserve.gateway.drain import DrainingGateway
    from tierserve.gateway.state import build_gateway_state
    from tierserve.server.http_guard import uvicorn_options
    from tierserve.server.listen_check import cannot_listen
    from tierserve.server.permissive import closed_tiers, log_permissive_settings

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    try:
        config = load_gateway_config(args.config)
        http = parse_http_limits(http_overrides(args), config.serve.server.http)
    except ConfigError as e:
        print(f"tierserve gateway: {e}", file=sys.stderr)
        return 2
    server = dataclasses.replace(config.serve.server, http=http)
    config = dataclasses.replace(config, serve=dataclasses.replace(config.serve, server=server))
    host = args.host or server.host
    port_number = server.port if args.port is None else args.port
    problem = cannot_listen(host, port_number)  # asked before the upstreams are polled
    if problem is not None:
        print(f"tierserve gateway: {problem}", file=sys.stderr)
        return 2
    log = logging.getLogger("tierserve.gateway")
    log_permissive_settings(config.serve, log, redis_fail_summary(config))
    for line in closed_tiers(config.serve) + waits_shorter_than_the_queues_way_out(config):
        log.warning("%s", line)
    gw = build_gateway_state(config)
    app = create_gateway_app(gw)
    uv_config = uvicorn.Config(
        app,
        host=host,
        port=port_number,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        **uvicorn_options(server.http, gw.metrics.count_http_error),
    )
    DrainingGateway(uv_config, gw, server.drain_timeout_s).run()
    return 0
