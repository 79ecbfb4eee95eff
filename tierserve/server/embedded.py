"""Run a server inside the current process, on its own thread and event loop (benchmarks, tests)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from tierserve.server.app import create_app
from tierserve.server.drain import DrainingServer
from tierserve.server.http_guard import uvicorn_options
from tierserve.server.state import ServerState


@dataclass
class EmbeddedServer:
    url: str  # http://127.0.0.1:PORT
    state: ServerState
    server: DrainingServer
    thread: threading.Thread


def loopback_socket() -> socket.socket:
    """A socket bound to a free port on 127.0.0.1 (the server listens on it; no race for the port).

    The protocol must be IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that
    say so, and without it Nagle's algorithm meets delayed ACKs and stalls each SSE chunk ~40 ms.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def embedded_server(
    state: ServerState,
    *,
    drain_timeout_s: float = 5.0,
    start_timeout_s: float = 30.0,
    freeze_heap: bool = False,
    engine_lost_linger_s: float = 1.0,
) -> Iterator[EmbeddedServer]:
    sock = loopback_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        create_app(state, freeze_heap=freeze_heap),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=2,
        **uvicorn_options(state.config.server.http, state.metrics.count_http_error),
    )
    server = DrainingServer(config, state, drain_timeout_s, engine_lost_linger_s)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="tierserve-http", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            sock.close()
            raise RuntimeError("the embedded server did not start")
        time.sleep(0.01)
    try:
        yield EmbeddedServer(f"http://127.0.0.1:{port}", state, server, thread)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
