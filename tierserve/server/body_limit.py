"""ASGI middleware that refuses request bodies over a size limit with 413.

A declared Content-Length over the limit is refused before the body is read; a body that
grows past the limit while streaming (chunked encoding) makes the read fail with
`BodyTooLarge`, which the app's error handler turns into the same 413.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierserve.server.errors import ApiError


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"Request body is larger than the limit of {limit} bytes.")


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self._app = app
        self._max = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
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
                    )
                    await error.response()(scope, receive, send)
                    return
        received = 0
        limit = self._max

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self._app(scope, limited, send)
