"""Graceful shutdown of a gateway: SIGTERM stops admission, in-flight requests finish.

New requests get 503 (`draining`) and /ready turns 503 while the requests already in
the gateway run to their end, up to the drain timeout (those in its queue are forwarded as
seats free up); then the streams still open end with an error event (`aborted`) and
`data: [DONE]`, the other requests with a 503 `aborted`, uvicorn shuts down and the
process exits with status 0. A second signal cuts the drain short in the same way, now;
a third, or any once the drain is over, forces an immediate exit (`GracefulServer`, as
`tierserve serve`).
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from tierserve.gateway.state import GatewayState
from tierserve.server.drain import GracefulServer

log = logging.getLogger("tierserve.gateway")
POLL_S = 0.05
CUT_GRACE_S = 2.0  # for the last event of each stream cut at the drain timeout to go out


class DrainingGateway(GracefulServer):
    def __init__(self, config: uvicorn.Config, gw: GatewayState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._gw = gw
        self._drain_timeout_s = drain_timeout_s

    def _begin_draining(self) -> None:
        self._gw.begin_draining()

    async def _drain(self, hurry: asyncio.Event) -> None:
        gw = self._gw
        log.info(
            "draining: admission stopped, requests in flight: %d (timeout %.1f s)",
            gw.num_in_flight,
            self._drain_timeout_s,
        )
        deadline = gw.clock.now() + self._drain_timeout_s
        while gw.num_in_flight > 0 and gw.clock.now() < deadline and not hurry.is_set():
            await asyncio.sleep(POLL_S)
        if gw.num_in_flight:
            why = "second signal" if hurry.is_set() else "drain timeout"
            n = gw.num_in_flight
            log.warning("%s: %d request%s still in flight cut", why, n, "" if n == 1 else "s")
            await self._cut_streams()
        log.info("drained; shutting down")
        self.should_exit = True

    async def _cut_streams(self) -> None:
        """End the streams still open with an error event and `data: [DONE]`, and the
        non-streaming calls with a 503 `aborted`, and wait (briefly) for those to go out
        before uvicorn closes the connections."""
        gw = self._gw
        gw.dispatcher.cutting = True  # a request leaving the queue now is cut, not left
        for relay in list(gw.relays):
            relay.cut()
        for call in list(gw.calls):
            call.cancel()
        deadline = gw.clock.now() + CUT_GRACE_S
        while (gw.relays or gw.calls) and gw.clock.now() < deadline:
            await asyncio.sleep(POLL_S)
