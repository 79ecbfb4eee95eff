"""The HTTP guard's send timeout: a client that reads none of its reply loses the connection,
and the application is told it went (so a generation for it stops)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tierserve.server.embedded import loopback_socket
from tierserve.server.http_guard import SEND_TIMEOUT, uvicorn_options
from tierserve.server.http_limits import HttpLimits

REPLY_BYTES = 64 << 20  # more than any socket buffers hold: the writer must wait on the reader
PART = 64 << 10
WAIT_S = 20.0


class Flood:
    """An ASGI app that streams REPLY_BYTES and notes how far it got and whether it was told
    that its client went."""

    def __init__(self) -> None:
        self.sent = 0
        self.told_gone = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await receive()  # the request (it has no body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while self.sent < REPLY_BYTES:
            await send({"type": "http.response.body", "body": b"x" * PART, "more_body": True})
            self.sent += PART
            if (await _gone(receive)) is True:
                self.told_gone.set()
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _gone(receive: Any) -> bool:
    """Whether the server has said the client went (uvicorn answers `receive` at once then)."""
    try:
        message = await asyncio.wait_for(receive(), timeout=0.001)
    except TimeoutError:
        return False
    return bool(message["type"] == "http.disconnect")


@contextmanager
def guarded(app: Flood, limits: HttpLimits, reasons: list[str]) -> Iterator[int]:
    sock = loopback_socket()
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", **uvicorn_options(limits, reasons.append)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _request(port: int) -> socket.socket:
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.settimeout(WAIT_S)
    client.connect(("127.0.0.1", port))
    client.sendall(b"GET /flood HTTP/1.1\r\nhost: t\r\n\r\n")
    return client


def test_a_client_that_reads_nothing_is_cut_off_at_the_send_timeout() -> None:
    app, reasons = Flood(), []
    with guarded(app, HttpLimits(send_timeout_s=0.3), reasons) as port, _request(port) as client:
        assert app.told_gone.wait(WAIT_S), f"still writing after {app.sent} bytes"
        received = 0
        try:
            while chunk := client.recv(1 << 20):  # what was in flight, then the end
                received += len(chunk)
        except ConnectionResetError:
            pass
    assert reasons == [SEND_TIMEOUT]
    assert received < app.sent < REPLY_BYTES


def test_a_client_that_reads_slowly_but_steadily_is_not_cut_off() -> None:
    # Each read lets the server write again well inside the timeout: the reply goes through.
    app, reasons = Flood(), []
    with guarded(app, HttpLimits(send_timeout_s=2.0), reasons) as port, _request(port) as client:
        received, deadline = 0, time.monotonic() + 60
        while received < 4 << 20 and time.monotonic() < deadline:
            received += len(client.recv(1 << 16))
            time.sleep(0.001)
    assert received >= 4 << 20 and reasons == []
