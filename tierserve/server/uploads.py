"""Request bodies still coming in when a server (or the gateway) starts draining.

Such a request can no longer be admitted, and with nothing else in flight the drain ends at
once: uvicorn then waited for the handler still reading the body, and cancelled it into a
plain-text 500 and a traceback. A drain now refuses these requests at its start, 503
`draining` with the rest of the body unread (the caller closes the connection).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request as HttpRequest

DRAINING = "draining"  # the message of the cancellation `Uploads.refuse_all` sends


class Uploads:
    """The handlers waiting for the rest of a request body."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def refuse_all(self) -> None:
        """Cut every read in progress short (call on the event loop)."""
        for task in self._tasks:
            task.cancel(DRAINING)

    async def read(self, http: HttpRequest) -> bytes | None:
        """The request's body, or None when `refuse_all` came while it was read."""
        task = asyncio.current_task()  # an ASGI app runs in a task: never None here
        if task is not None:
            self._tasks.add(task)
        try:
            # Read from the stream, not `http.body()`: that keeps a copy on the request, which
            # lives as long as the request (through the gateway's queue and its attempts).
            return b"".join([chunk async for chunk in http.stream()])
        except asyncio.CancelledError as e:
            if task is None or e.args != (DRAINING,):
                raise
            task.uncancel()
            return None
        finally:
            if task is not None:
                self._tasks.discard(task)
