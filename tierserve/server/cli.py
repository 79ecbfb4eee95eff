"""`tierserve serve`: the OpenAI-compatible server.

Import cost stays low: FastAPI, uvicorn and torch are imported inside `run`.
"""

from __future__ import annotations

import argparse
import logging
import sys

POLICIES = ("fcfs", "strict", "drr", "drr-tokens", "wfq", "hybrid", "vllm-priority")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible API with priority tiers",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models, /metrics, /health and /ready. "
        "With no --config the server is open (no keys, no rate limits).",
    )
    p.add_argument("--host", default=None, help="bind address (default: [server].host or 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: [server].port or 8000)")
    p.add_argument(
        "--backend",
        choices=("torch", "sim"),
        default="torch",
        help="torch: a real model; sim: a time-faithful simulated deployment (default: torch)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="torch: 'demo' or a Hugging Face directory; sim: a model name such as llama-3.1-70b",
    )
    p.add_argument("--gpu", default=None, help="sim: GPU profile (default A100-80GB)")
    p.add_argument("--tp", type=int, default=None, help="sim: tensor-parallel GPUs (default 8)")
    p.add_argument("--device", default="cpu", help="torch: cpu or cuda (default cpu)")
    p.add_argument("--policy", choices=POLICIES, default="hybrid", help="scheduling policy (default hybrid)")
    p.add_argument(
        "--config", default=None, help="TOML: [scheduler], [tiers.*], [server], [limits], [tenants.*]"
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tierserve.config import ConfigError
    from tierserve.server.app import create_app
    from tierserve.server.backends import BackendSpec
    from tierserve.server.config import load_serve_config
    from tierserve.server.drain import DrainingServer
    from tierserve.server.engine_client import EngineStartError
    from tierserve.server.state import spawn_state

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("tierserve.server")
    try:
        config = load_serve_config(args.config)
    except ConfigError as e:
        print(f"tierserve serve: {e}", file=sys.stderr)
        return 2
    if config.source is None:
        log.warning("no --config: the server is OPEN (no API keys, no rate limits, default tiers)")
    host = args.host or config.server.host
    port = config.server.port if args.port is None else args.port
    backend = BackendSpec(args.backend, args.model, args.gpu, args.tp, args.device)
    try:  # the engine, and the model, are built in a process of their own
        state = spawn_state(config, backend, policy=args.policy, log_level=args.log_level.upper())
    except EngineStartError as e:
        print(f"tierserve serve: {e}", file=sys.stderr)
        return 2
    app = create_app(state, freeze_heap=True)
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=args.log_level, access_log=False, timeout_graceful_shutdown=5
    )
    server = DrainingServer(uv_config, state, config.server.drain_timeout_s)
    try:
        server.run()
    finally:
        state.engine.kill()  # only if uvicorn never started it, or never stopped it
    return server.exit_code
