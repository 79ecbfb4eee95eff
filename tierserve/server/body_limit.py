"""ASGI middleware that bounds request bodies: each one's size (413 past it), and the bytes
all of them may be sending at once (503 `busy` past that).

A declared Content-Length over the limit is refused before the body is read; a body that
grows past the limit while streaming (chunked encoding) makes the read fail with
`BodyTooLarge`, which the app's error handler turns into the same 413. Either closes the
connection: the rest of the body is never read.

The size limit alone lets every open connection upload a body of the largest size at once
(`max_connections` x `max_body_bytes`: 512 MiB with the defaults, gigabytes where the limit
is raised for long contexts). So the bytes of a body past its first `UNCHARGED_BYTES` (64
KiB, which the connection cap bounds: 32 MiB with the defaults; each part it arrives in
counts `MESSAGE_COST` bytes at the least) are taken from a budget shared by all requests as
they arrive, once the application reads the body (after the API key is checked), and given
back once its last byte is in. A body that would pass the budget is refused with 503 `busy`
and Retry-After, the rest of it unread (the connection is closed), and the client may send
it again shortly; one whose Content-Length alone would pass what is left is refused before
a byte of it is read.

Bytes as they arrive, not a body's size: reserving its Content-Length (a chunked one's, the
size limit) when the application began reading it let 64 connections that each sent one
byte of a 1 MiB body shut every other body out, a 50-byte P0 request too, for as long as the
body timeout let them stall (an attack trial, 2026-12-07).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierserve.server.errors import ApiError


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        # The rest of the body is not read: closing is the way to not read it (kept alive,
        # the server read and threw away whatever the client went on sending).
        super().__init__(
            413, f"Request body is larger than the limit of {limit} bytes.", headers={"connection": "close"}
        )


class BodyBudgetSpent(HTTPException):
    def __init__(self, budget: int) -> None:
        super().__init__(
            503,
            f"Too many request bodies are being uploaded at once (over {budget} bytes); retry shortly.",
            headers={"Retry-After": "1", "connection": "close"},
        )


class BodyBudget:
    """Bytes of request bodies being received at once, up to `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0

    def take(self, num_bytes: int) -> bool:
        if self.held + num_bytes > self.max_bytes:
            return False
        self.held += num_bytes
        return True

    def give(self, num_bytes: int) -> None:
        self.held -= num_bytes

    def room(self) -> int:
        return self.max_bytes - self.held


UNCHARGED_BYTES = 64 << 10  # of each body, not taken from the budget: the connection cap bounds them
# What a part of a body counts for at the least: the app keeps each as a bytes object (about
# 40 bytes besides its own), and a body sent a byte a segment grew the server 40 times its size.
MESSAGE_COST = 64


class BodyLimitMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        max_buffered_bytes: int | None = None,
        count: Callable[[str], None] | None = None,
        uncharged_bytes: int = UNCHARGED_BYTES,
    ) -> None:
        """`count`: told the reason of each refusal it answers itself (`tierserve_http_errors_total`)."""
        self._app = app
        self._count = count
        self._max = max_bytes
        self._uncharged = uncharged_bytes
        self.budget = BodyBudget(max_buffered_bytes) if max_buffered_bytes is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared: int | None = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self._max:
                    error = ApiError(
                        413,
                        f"Request body is larger than the limit of {self._max} bytes.",
                        code="request_too_large",
                        headers={"connection": "close"},  # unread (see BodyTooLarge)
                    )
                    if self._count is not None:
                        self._count("request_too_large")
                    await error.response()(scope, receive, send)
                    return
        received = counted = held = 0
        limit, budget, uncharged = self._max, self.budget, self._uncharged
        first = True

        async def limited() -> Message:
            nonlocal received, counted, held, first
            if first and budget is not None and declared is not None:
                first = False  # a body whose declared size would pass what is left: unread
                if declared - uncharged > budget.room():
                    raise BodyBudgetSpent(budget.max_bytes)
            message = await receive()
            if message["type"] == "http.request":
                size = len(message.get("body", b""))
                received += size
                if received > limit:
                    raise BodyTooLarge(limit)
                counted += max(size, MESSAGE_COST)
                charge = counted - uncharged - held
                if charge > 0 and budget is not None:
                    if not budget.take(charge):
                        raise BodyBudgetSpent(budget.max_bytes)
                    held += charge
            last = message["type"] != "http.request" or not message.get("more_body", False)
            if held and last and budget is not None:
                budget.give(held)
                held = 0
            return message

        try:
            await self._app(scope, limited, send)
        finally:
            if held and budget is not None:
                budget.give(held)
