"""Graceful shutdown: SIGTERM stops admission, running requests finish, then uvicorn exits.

uvicorn's own handling would close the listening socket at once (new clients get
"connection refused", not a 503) and re-raise the signal after shutdown (exit status
143). `DrainingServer` instead marks the server draining (new requests: 503, /ready:
503), waits up to the drain timeout for in-flight requests, aborts whatever is left,
and then lets uvicorn shut down normally, so the process exits with status 0. A client
that reads none of its reply does not hold the drain: once the engine has ended the requests
left, a connection whose queued bytes have not moved for `UNREAD_GRACE_S` is closed
(`UnreadReplies`), one log line for those closed together.
A second signal cuts the drain short: what is left is aborted at once (each client gets
the same 503 or stream error event as at the drain timeout) and the server exits; a third,
or any once the drain is over, forces an immediate exit (`GracefulServer`, which the
gateway's drain shares).

If the engine process dies, the server cannot serve: requests in flight end with an error
(503, or a stream's error event) and new ones get 503 for `engine_lost_linger_s` (so a
load balancer sees the failure as an answer, not a refused connection); then the server
exits with `exit_code` 1.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import socket
import time
from collections.abc import Collection
from types import FrameType
from typing import Any

import uvicorn

from tierserve.server.state import ServerState

log = logging.getLogger("tierserve.server")
ENGINE_LOST_LINGER_S = 1.0
# A reply whose client has read none of it for this long, once the engine has ended every
# request the drain waits for, is closed (the rest of it would only wait for that client).
UNREAD_GRACE_S = 1.0
MAX_PEERS_LOGGED = 5  # client addresses named in the line that reports such closings
POLL_S = 0.02  # how often the drain looks at what is left
SAME_SIGNAL_S = 0.5  # a signal again within this is the same one, delivered twice


class GracefulServer(uvicorn.Server, abc.ABC):
    """uvicorn's server, drained on a signal: the first begins the drain (`_begin_draining`
    stops admission, `_drain` waits and cuts what is left), a second cuts it short (the
    event `_drain` is given is set), and a third, or any once the drain is over (uvicorn
    waiting on connections or its lifespan), forces an immediate exit. The same signal again
    within `SAME_SIGNAL_S` counts once: `timeout 900 tierserve serve` cut its drain short at
    once, GNU timeout sending SIGTERM to its child and then to the child's process group."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._hurry: asyncio.Event | None = None  # set by a second signal while draining
        self._last_signal: tuple[int, float] = (0, -math.inf)  # (signal, monotonic time) of the last

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if sig == self._last_signal[0] and now - self._last_signal[1] < SAME_SIGNAL_S:
            return  # one signal, delivered twice (GNU timeout signals its child, then its group)
        self._last_signal = (sig, now)
        loop, drain = self._loop, self._drain_task
        hurried = self._hurry is not None and self._hurry.is_set()
        if loop is None or hurried or (drain is not None and drain.done()):
            self.force_exit = True
            self.should_exit = True
        elif drain is not None:
            loop.call_soon_threadsafe(self.hurry_drain)
        else:
            loop.call_soon_threadsafe(self.begin_drain)

    def begin_drain(self) -> None:
        """Start draining (call on the server's event loop, or via `call_soon_threadsafe`)."""
        if self._drain_task is not None:
            return
        self._begin_draining()
        self._hurry = asyncio.Event()
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(self._hurry))

    def hurry_drain(self) -> None:
        """Cut what is left of the drain now (on the server's event loop)."""
        if self._hurry is not None:
            self._hurry.set()

    @abc.abstractmethod
    def _begin_draining(self) -> None:
        """Stop admitting: new requests get 503 `draining`, /ready turns 503."""

    @abc.abstractmethod
    async def _drain(self, hurry: asyncio.Event) -> None:
        """Wait for what is in flight (up to the drain timeout, or until `hurry` is set),
        cut what is left, then set `should_exit`."""


class DrainingServer(GracefulServer):
    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        drain_timeout_s: float,
        engine_lost_linger_s: float = ENGINE_LOST_LINGER_S,
    ) -> None:
        super().__init__(config)
        self._state = state
        self._drain_timeout_s = drain_timeout_s
        self._linger_s = engine_lost_linger_s
        self.exit_code = 0  # what the process should exit with once `run` returns
        self._lost_task: asyncio.Task[None] | None = None
        state.engine.on_lost = self._engine_lost

    def _engine_lost(self) -> None:
        """Called on the event loop when the engine process has died."""
        self.exit_code = 1
        self._state.begin_draining()
        if self._loop is not None and self._lost_task is None:
            self._lost_task = self._loop.create_task(self._exit_after_lost())

    async def _exit_after_lost(self) -> None:
        await asyncio.sleep(self._linger_s)
        await self._state.engine.wait_idle(self._linger_s)
        log.error("the engine process is gone: shutting down (exit status 1)")
        self.should_exit = True

    def _begin_draining(self) -> None:
        self._state.begin_draining()

    async def _drain(self, hurry: asyncio.Event) -> None:
        engine = self._state.engine
        log.info(
            "draining: admission stopped, requests in flight: %d (timeout %.1f s)",
            engine.num_in_flight,
            self._drain_timeout_s,
        )
        unread = UnreadReplies(self.server_state.connections)
        if not await self._settle(unread, self._drain_timeout_s, hurry):
            why = "second signal" if hurry.is_set() else "drain timeout"
            n = engine.num_in_flight
            log.warning("%s: aborting %d request%s", why, n, "" if n == 1 else "s")
            await engine.stop()
            await self._settle(unread, 2.0, None)
        # A cut stream's last chunks, or a whole reply, may still wait for a client reading
        # none of it, its request over: uvicorn would wait for it and then cancel its handler.
        while unread.close_stuck(time.monotonic()):
            await asyncio.sleep(POLL_S)
        log.info("drained; shutting down")
        self.should_exit = True

    async def _settle(self, unread: UnreadReplies, timeout_s: float, hurry: asyncio.Event | None) -> bool:
        """Wait until every request's handler is done (True), or `timeout_s` passes or `hurry`
        is set (False). Once the engine has ended every request left, a reply whose client
        reads none of it is closed after `UNREAD_GRACE_S`: its handler, waiting in uvicorn's
        flow control, held the drain to its timeout."""
        engine = self._state.engine
        deadline = time.monotonic() + timeout_s
        while engine.num_in_flight:
            now = time.monotonic()
            if now >= deadline or (hurry is not None and hurry.is_set()):
                return False
            if not engine.num_generating:
                unread.close_stuck(now)
            await asyncio.sleep(POLL_S)
        return True


class UnreadReplies:
    """Connections with reply bytes queued that their clients do not read: the transport's
    write buffer holds some and has not shrunk since it was last looked at. (Writing stops on a
    full buffer, the handler waiting in uvicorn's flow control; a reply already written whole
    keeps the connection open, uvicorn's shutdown waiting for it to be flushed.)"""

    def __init__(self, connections: Collection[Any]) -> None:
        self._connections = connections
        self._stuck_since: dict[Any, tuple[float, int]] = {}  # connection: (since, bytes queued)

    def close_stuck(self, now: float) -> bool:
        """Close those whose queued bytes have not shrunk for `UNREAD_GRACE_S`, with one log
        line for them all: a handler still writing sees its client gone and ends, as at
        `send_timeout_s`. True while some have bytes queued, not yet for that long."""
        looked: dict[Any, tuple[float, int]] = {}
        for connection in list(self._connections):
            queued = _queued_bytes(connection)
            if queued:
                since, before = self._stuck_since.get(connection, (now, queued))
                looked[connection] = (since if queued >= before else now, queued)
        stuck = [c for c, (since, _) in looked.items() if now - since >= UNREAD_GRACE_S]
        for connection in stuck:
            del looked[connection]
            connection.transport.abort()
        self._stuck_since = looked
        if stuck:
            peers = ", ".join(_peer(c) for c in stuck[:MAX_PEERS_LOGGED])
            more = f" and {len(stuck) - MAX_PEERS_LOGGED} more" if len(stuck) > MAX_PEERS_LOGGED else ""
            log.warning(
                "draining: closed %d connection(s) whose client read none of its reply for %g s (%s%s)",
                len(stuck),
                UNREAD_GRACE_S,
                peers,
                more,
            )
        return bool(looked)


def _queued_bytes(connection: Any) -> int:
    """Bytes of a connection's replies waiting in its transport, not yet in the socket's."""
    transport = getattr(connection, "transport", None)
    size: int = transport.get_write_buffer_size() if transport is not None else 0
    return size


def _peer(connection: Any) -> str:
    client = getattr(connection, "client", None)
    return f"{client[0]}:{client[1]}" if client else "?"
