"""Graceful shutdown: SIGTERM stops admission, running requests finish, then uvicorn exits.

uvicorn's own handling would close the listening socket at once (new clients get
"connection refused", not a 503) and re-raise the signal after shutdown (exit status
143). `DrainingServer` instead marks the server draining (new requests: 503, /ready:
503), waits up to the drain timeout for in-flight requests, aborts whatever is left,
and then lets uvicorn shut down normally, so the process exits with status 0.
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
from types import FrameType

import uvicorn

from tierserve.server.state import ServerState

log = logging.getLogger("tierserve.server")
ENGINE_LOST_LINGER_S = 1.0
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
        idle = asyncio.ensure_future(engine.wait_idle(self._drain_timeout_s))
        hurried = asyncio.ensure_future(hurry.wait())
        await asyncio.wait((idle, hurried), return_when=asyncio.FIRST_COMPLETED)
        if not (idle.done() and idle.result()):
            why = "second signal" if hurry.is_set() else "drain timeout"
            log.warning("%s: aborting %d requests", why, engine.num_in_flight)
            idle.cancel()
            await engine.stop()
            await engine.wait_idle(2.0)
        hurried.cancel()
        log.info("drained; shutting down")
        self.should_exit = True
