"""An ASGI response for server-sent events that commits its status late and notices disconnects.

The status line is sent with the first chunk, which the stream produces once the engine
has accepted the request (before its first token, so that token's chunk is one write):
an error found before that (the engine refused the request) still gets a proper 4xx/5xx.
A watcher reads `receive` for `http.disconnect` and calls `on_disconnect` at once, so
the request is aborted even while no token is flowing; after that nothing more is sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tierserve.server.errors import ApiError


def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> asyncio.Task[None]:
    """A task that calls `on_disconnect` when the client goes away; cancel it when done."""

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.get_running_loop().create_task(watch())


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(
        self, chunks: AsyncIterator[bytes], headers: dict[str, str], on_disconnect: Callable[[], None]
    ) -> None:
        # Not Response.__init__: this response sends its own status line and headers.
        self.status_code = 200
        self.background = None
        self._chunks = chunks
        self._raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self._raw_headers += [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
        ]
        self._on_disconnect = on_disconnect
        self._gone = False
        self._done = False

    def _disconnected(self) -> None:
        if not self._done:
            self._gone = True
            self._on_disconnect()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = watch_disconnect(receive, self._disconnected)
        chunks: Any = self._chunks
        try:
            try:
                first = await anext(chunks, b"")
            except ApiError as e:
                await _send_error(e, scope, receive, send)
                return
            if self._gone:
                return
            await send({"type": "http.response.start", "status": 200, "headers": self._raw_headers})
            await _body(send, first, self._gone)
            async for chunk in chunks:
                if self._gone:
                    return
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            self._done = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            self._disconnected()
        finally:
            self._done = True
            watcher.cancel()
            await chunks.aclose()


async def _body(send: Send, chunk: bytes, gone: bool) -> None:
    if chunk and not gone:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def _send_error(error: ApiError, scope: Scope, receive: Receive, send: Send) -> None:
    response: Callable[[Scope, Receive, Send], Awaitable[None]] = error.response()
    await response(scope, receive, send)
