"""Graceful shutdown of a gateway: SIGTERM stops admission, in-flight requests finish.

New requests get 503 (`draining`) and /ready turns 503 while the requests already
forwarded run to their end, up to the drain timeout; then the streams still open end
with an error event (`aborted`) and `data: [DONE]`, the other requests with a 503
`aborted`, uvicorn shuts down and the process exits with status 0. A second signal forces
an immediate exit.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn

from tierserve.gateway.state import GatewayState

log = logging.getLogger("tierserve.gateway")
POLL_S = 0.05
CUT_GRACE_S = 2.0  # for the last event of each stream cut at the drain timeout to go out


class DrainingGateway(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, gw: GatewayState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._gw = gw
        self._drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None:
            self.force_exit = True
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        if self._drain_task is None:
            self._gw.begin_draining()
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        gw = self._gw
        log.info("draining: admission stopped, requests in flight: %d", gw.num_in_flight)
        deadline = gw.clock.now() + self._drain_timeout_s
        while gw.num_in_flight > 0 and gw.clock.now() < deadline:
            await asyncio.sleep(POLL_S)
        if gw.num_in_flight:
            log.warning("drain timeout: %d requests still in flight are cut", gw.num_in_flight)
            await self._cut_streams()
        log.info("drained; shutting down")
        self.should_exit = True

    async def _cut_streams(self) -> None:
        """End the streams still open with an error event and `data: [DONE]`, and the
        non-streaming calls with a 503 `aborted`, and wait (briefly) for those to go out
        before uvicorn closes the connections."""
        gw = self._gw
        for relay in list(gw.relays):
            relay.cut()
        for call in list(gw.calls):
            call.cancel()
        deadline = gw.clock.now() + CUT_GRACE_S
        while (gw.relays or gw.calls) and gw.clock.now() < deadline:
            await asyncio.sleep(POLL_S)
