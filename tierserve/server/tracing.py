"""Opt-in per-request timestamps, to measure the API layer's own latency (`bench serve`).

With tracing on, an outermost ASGI middleware stamps when the app had received a
request's whole body (so a slow client's upload is not counted), and the generation
handler stamps when the first token's chunk had been handed to the
transport. Together with the engine's own TTFT (`EngineClient.ttft_trace`) this gives the
time the HTTP layer adds, with neither the client nor the network in it. All times are
`time.monotonic()`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

RECEIVED_AT = "tierserve.received_at"


@dataclass(slots=True)
class TraceRecord:
    received_at: float  # the app had the request's whole body
    first_sent_at: float | None = None  # the first token's chunk was handed to the transport


class ServeTrace:
    def __init__(self) -> None:
        self.records: dict[str, TraceRecord] = {}


class ReceivedAtMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return

        async def stamped() -> Message:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                scope[RECEIVED_AT] = time.monotonic()
            return message

        await self._app(scope, stamped, send)
