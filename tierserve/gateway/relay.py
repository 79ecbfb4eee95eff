"""Passing an upstream's SSE stream on to the client, whole events as they come.

Once the first bytes have gone out the request can no longer move to another upstream:
if the upstream breaks now (its connection drops, or its reply ends without `data: [DONE]`),
the stream ends with an error event (`upstream_failed`) and `data: [DONE]`, so the client
always sees how it ended; so does a stream the gateway cuts at its drain timeout (`aborted`).
When it ends, however it ends, the request leaves the router's in-flight count and its
reservation is settled with the usage the upstream reported (or kept whole when none came).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import aiohttp

from tierserve.gateway.router import RouteDecision
from tierserve.gateway.state import GatewayState
from tierserve.gateway.usage import EventTooLarge, SseUsageTap
from tierserve.server.formatting import DONE, error_event
from tierserve.server.ratelimit import Reservation

log = logging.getLogger("tierserve.gateway")
END_AFTER_DONE_S = 1.0  # how long the upstream's end is waited for after `data: [DONE]`


class Relay:
    """Passes an upstream's SSE stream on; ends with an error event if the upstream breaks."""

    def __init__(
        self,
        gw: GatewayState,
        decision: RouteDecision,
        reservation: Reservation | None,
        reply: aiohttp.ClientResponse,
        chunks: AsyncIterator[bytes],
        tap: SseUsageTap,
        first_bytes: tuple[float, float],
    ) -> None:
        """`first_bytes`: the gateway's time before the upstream call (s), and when the
        upstream's first bytes came in (a perf_counter()); once they are out, the two give
        the gateway's added latency."""
        self._gw, self._decision, self._reservation = gw, decision, reservation
        self._name = decision.upstream
        self._reply, self._chunks, self._tap = reply, chunks, tap
        self._outcome = "ok"
        self._client_gone = False
        self._first_bytes = first_bytes

    def client_left(self) -> None:
        self._client_gone = True
        if not self._tap.done:  # after it, the client had the whole stream (OpenAI's closes on it)
            self._outcome = "client_left"
        self._reply.close()  # drops the upstream connection: the upstream sees the client go

    def cut(self) -> None:
        """The gateway is shutting down (its drain timed out): the stream ends now with an
        error event and `data: [DONE]`."""
        if self._outcome == "ok" and not self._tap.done:  # after [DONE] the stream is whole
            self._outcome = "cut"
            self._reply.close()

    async def run(self, first: bytes) -> AsyncIterator[bytes]:
        """`first`: the stream's first whole events, already through the tap."""
        tap = self._tap
        self._gw.relays.add(self)
        try:
            yield first
            # Resumed once the first bytes are with the server's transport.
            before_s, first_in = self._first_bytes
            self._gw.metrics.added.observe(before_s + time.perf_counter() - first_in)
            try:
                while not tap.done:  # the first events may have held the whole stream
                    chunk = await anext(self._chunks, None)
                    if chunk is None:
                        break
                    out = tap.feed(chunk)
                    if out:
                        yield out
                if tap.done:
                    await self._await_end()
                    return
            except (aiohttp.ClientError, TimeoutError, EventTooLarge) as e:
                if self._client_gone:
                    return
                # An event cut short stays behind: the client gets whole events only.
                too_large = isinstance(e, EventTooLarge)
                tail = b"" if too_large else tap.flush()
                if tap.done:  # `data: [DONE]` was the last thing whole: the stream is
                    yield tail
                    return
                yield tail + self._error_event(str(e) if too_large else type(e).__name__) + DONE
                return
            rest = tap.flush()
            if tap.done or self._client_gone:
                if rest:
                    yield rest
                return
            # A clean end without `data: [DONE]` (an upstream that stopped early, or a stream
            # the gateway cut): the client hears that it did not run to its end.
            yield rest + self._error_event("the reply ended before data: [DONE]") + DONE
        finally:
            self._close()

    async def _await_end(self) -> None:
        """After `data: [DONE]` the stream is whole: the upstream's end is waited for a
        moment, so that its connection goes back to the pool, but no longer (an upstream
        that lingered after it held the request in flight until the read timeout, and the
        stream was counted broken)."""
        try:
            async with asyncio.timeout(END_AFTER_DONE_S):
                async for _ in self._chunks:
                    pass  # nothing after [DONE] is for the client
        except (aiohttp.ClientError, TimeoutError):
            pass  # `_close` releases the reply, closing a connection not read to its end

    def _error_event(self, error: str) -> bytes:
        """The last event of a stream that did not run to its end: cut by the gateway, or
        broken by the upstream (`error`: what broke it)."""
        if self._outcome == "cut":
            return error_event(
                "the gateway is shutting down: its drain ended before this stream did", code="aborted"
            )
        self._outcome = "broken"
        log.warning("upstream %s broke a stream midway: %s", self._name, error)
        # Which one is in the log line above: an upstream's name is often its address, which
        # a 502 keeps from the client too.
        return error_event("The upstream serving this stream failed mid-stream.", code="upstream_failed")

    def _close(self) -> None:
        gw = self._gw
        gw.relays.discard(self)
        gw.num_in_flight -= 1
        gw.dispatcher.finished(self._decision)
        gw.metrics.upstream_requests.labels(self._name, self._outcome).inc()
        if self._outcome == "ok":
            gw.router.record_request_success(self._name)
        usage = self._tap.usage
        reservation = self._reservation
        used = usage.total if usage else (reservation.num_tokens if reservation else 0)
        gw.spawn(gw.limiter.settle(reservation, used))
        self._reply.release()  # back to the pool when read to the end; closed otherwise
