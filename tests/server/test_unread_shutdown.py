"""SIGTERM while clients read none of their streams: the drain ends as usual, and shutdown
closes those connections with one log line, not a CancelledError traceback per connection
(uvicorn cancelled each handler still waiting in its flow-control drain, 2 s on)."""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

from tests.server.helpers import MODEL, end_counts, live_server, make_state, pool_free_and_total
from tests.server.test_http_limits import completion_head
from tierserve.server import embedded

SEND_BUFFER = 4096  # bytes: the server's socket send buffer, so that an unread reply fills it
NUM_CLIENTS = 2


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(logging.Formatter().format(record))


@contextmanager
def _server_log() -> Iterator[list[str]]:
    """What the server logs (uvicorn's and tierserve's loggers), tracebacks included. Enter it
    once the server has started: uvicorn's logging set-up replaces the loggers' handlers."""
    handler = _Lines()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "tierserve")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


def _small_send_buffer_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)  # accepted sockets inherit it
    sock.bind(("127.0.0.1", 0))
    return sock


def _open_stream(host: str, port: int, max_tokens: int) -> socket.socket:
    """A streaming completion whose client reads its status line and nothing more."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": max_tokens, "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SEND_BUFFER)
    sock.settimeout(10)
    sock.connect((host, port))
    sock.sendall(completion_head(len(body)) + body)
    assert sock.recv(12).startswith(b"HTTP/1.1 200")
    return sock


@pytest.mark.parametrize(
    ("drain_timeout_s", "max_tokens", "cut"),
    [(30.0, 800, False), (0.3, 3000, True)],
    ids=["finished-in-the-drain", "cut-at-the-drain-timeout"],
)
def test_sigterm_with_unread_streams_drains_and_closes_them_without_tracebacks(
    monkeypatch: pytest.MonkeyPatch, drain_timeout_s: float, max_tokens: int, cut: bool
) -> None:
    """Replies of 800 tokens (~150 KB) cannot fit the buffers; uvicorn's 2 s of graceful
    shutdown then cancelled each handler, one traceback each, after the drain had waited its
    whole timeout for them."""
    monkeypatch.setattr(embedded, "loopback_socket", _small_send_buffer_socket)
    state = make_state(max_model_len=4096, step_s=0.0005)
    stop = state.engine.stop
    at_stop: list[object] = []

    async def stop_after_looking() -> None:  # the engine as the drain leaves it
        if not at_stop:
            at_stop.extend(
                [await state.engine.inspect(end_counts), await state.engine.inspect(pool_free_and_total)]
            )
        await stop()

    state.engine.stop = stop_after_looking  # type: ignore[method-assign]
    with live_server(state, drain_timeout_s=drain_timeout_s) as srv, _server_log() as server_log:
        parts = urlsplit(srv.url)
        clients = [
            _open_stream(parts.hostname or "", parts.port or 80, max_tokens) for _ in range(NUM_CLIENTS)
        ]
        try:
            srv.signal()  # SIGTERM
            srv.thread.join(timeout=20)
            assert not srv.thread.is_alive() and srv.server.exit_code == 0, "\n".join(server_log)
        finally:
            for client in clients:
                client.close()
    text = "\n".join(server_log)
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert "graceful shutdown exceeded" not in text, text  # uvicorn waited for no connection
    assert any("drained; shutting down" in line for line in server_log)
    assert any(f"aborting {NUM_CLIENTS} requests" in line for line in server_log) is cut, text
    closed = [re.search(r"closed (\d+) connection\(s\) whose client read none", line) for line in server_log]
    assert sum(int(m.group(1)) for m in closed if m) == NUM_CLIENTS, text  # a line for them, not each
    assert srv.state.engine.num_in_flight == 0
    (finished, aborted, rejected), (free, total) = at_stop  # type: ignore[misc]
    if cut:  # the engine as the drain's timeout found it: still generating both
        assert (finished, aborted, rejected) == (0, 0, 0) and free < total
    else:  # as the drain left it: both finished, the KV blocks whole
        assert (finished, aborted, rejected) == (NUM_CLIENTS, 0, 0) and free == total
