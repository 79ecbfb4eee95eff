"""The HTTP server's end of the engine process (the `EngineService` the routes use).

`EngineClient.spawn` starts `engine_main` (engine_core.py) with multiprocessing's spawn
context and waits for its `EngineReady`. On the event loop, commands are batched into one
pipe write per loop iteration; the pipe's other direction is watched with `add_reader`,
and each `StepOutputs` is routed to the handlers' `RequestHandle`s through the same
`Dispatcher` as in-process (first tokens ahead of queued deltas); once a step's first
tokens' handlers have run, `FirstsHandled` tells the engine process, which waits for it.
The admission snapshot arrives with the step's second message; `/metrics` asks the engine
for its metric families.

If the engine process dies, every request in flight ends with an error delta, every new
one fails at once (the handler answers 503), and `on_lost` is called so that the server
can exit non-zero.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from prometheus_client import Metric

from tierserve.engine import Engine
from tierserve.request import FinishReason, Request
from tierserve.server.admission import ThroughputMeter
from tierserve.server.backends import BackendError
from tierserve.server.engine_core import engine_main
from tierserve.server.engine_messages import (
    AbortRequest,
    AddRequest,
    Answer,
    Command,
    EngineFailed,
    EngineReady,
    EngineRecipe,
    FinishRequest,
    FirstsHandled,
    Inspect,
    ScrapeMetrics,
    Shutdown,
    StepOutputs,
)
from tierserve.server.state_metrics import EngineSnapshot
from tierserve.server.streams import ACCEPTED, Delta, Dispatcher, RequestHandle
from tierserve.tiers import ALL_TIERS, Tier

log = logging.getLogger("tierserve.server")
ENGINE_LOST = "the engine process is gone"
SCRAPE_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 10.0  # for the engine process to exit when asked, before it is killed


class EngineStartError(Exception):
    """The engine process could not start; the message says why."""


class EngineClient:
    def __init__(
        self, process: BaseProcess, conn: Connection, ready: EngineReady, meter: ThroughputMeter
    ) -> None:
        self.process = process
        self.ready = ready
        self._conn = conn
        self._meter = meter
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatcher: Dispatcher | None = None
        self._outbox: list[Command] = []
        self._handles: dict[str, RequestHandle] = {}  # requests not yet closed by their handler
        self._routes: dict[str, RequestHandle] = {}  # requests the engine has not ended yet
        self._started: set[str] = set()  # routed requests that have had a token
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._scrape: asyncio.Future[Any] | None = None  # the last metrics scrape asked of the engine
        self._call_ids = itertools.count()
        self._submitted = dict.fromkeys(ALL_TIERS, 0)
        self._applied = dict.fromkeys(ALL_TIERS, 0)
        self._reading = False
        # When the engine process last sent anything, or was given work while it had none.
        self._heard_at = time.monotonic()
        self._died = False
        self._stopping = False
        self.snapshot = EngineSnapshot()
        self.num_step_errors = 0
        self.on_lost: Callable[[], None] | None = None
        self.ttft_trace: dict[str, tuple[float, float]] | None = (
            None  # id -> (in-process TTFT, step returned at)
        )

    @classmethod
    def spawn(
        cls, recipe: EngineRecipe, meter: ThroughputMeter, *, start_timeout_s: float = 300.0
    ) -> EngineClient:
        """Start the engine process and wait until its engine is built."""
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=True)
        process = ctx.Process(target=engine_main, args=(recipe, theirs), name="tierserve-engine", daemon=True)
        process.start()
        theirs.close()  # ours sees EOF once the engine process is gone
        deadline = time.monotonic() + start_timeout_s
        while not ours.poll(0.1):
            if not process.is_alive() or time.monotonic() > deadline:
                _end_process(process, 1.0)
                raise EngineStartError(f"the engine process did not start ({how_it_ended(process.exitcode)})")
        try:
            first = ours.recv()
        except (EOFError, OSError):
            first = None
        if isinstance(first, EngineFailed):
            _end_process(process, 5.0)
            raise (BackendError if first.bad_setting else EngineStartError)(first.message)
        if not isinstance(first, EngineReady):
            _end_process(process, 1.0)
            raise EngineStartError(f"the engine process did not start ({how_it_ended(process.exitcode)})")
        log.info("engine process started (pid %d)", first.pid)
        return cls(process, ours, first, meter)

    @property
    def pid(self) -> int:
        return self.ready.pid

    # ---- lifecycle (event loop) -------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._dispatcher = Dispatcher(self._loop, threading.Event())
        fd = self._conn.fileno()
        self._loop.add_reader(fd, self._on_readable)
        # uvloop (libuv) makes a watched fd non-blocking; `Connection` needs it blocking, or a
        # message half-sent or half-arrived raises BlockingIOError and breaks the framing.
        os.set_blocking(fd, True)
        self._reading = True

    @property
    def running(self) -> bool:
        return not self._died and not self._stopping

    def silent_s(self) -> float:
        """How long the engine process has had work (requests or calls) and sent nothing; 0
        when it has none. A step sends a message when it ends, so this is the step in flight,
        and a long one means an engine hung or stopped (SIGSTOP, a deadlock, a stuck device)."""
        if not self._routes and not self._calls:
            return 0.0
        return time.monotonic() - self._heard_at

    @property
    def died(self) -> bool:
        """The engine process ended without being asked to."""
        return self._died

    async def stop(self) -> None:
        """Abort what is left, tell the engine process to exit, and wait for it."""
        if self._stopping:
            return
        for request_id in list(self._handles):
            self.abort(request_id)
        self._send(Shutdown())
        self._flush()
        self._stopping = True
        await asyncio.to_thread(_end_process, self.process, STOP_TIMEOUT_S)
        self._stop_reading()
        self._fail_routes("server shutting down")
        status = self.process.exitcode
        if status == 0:
            log.info("engine process exited (status 0)")
        else:  # killed after it did not exit in time (a stopped or hung engine), or failed
            log.warning("engine process did not exit cleanly (%s)", how_it_ended(status))

    def kill(self) -> None:
        """End the engine process now if it is still there (the server stopped without `stop`)."""
        if self.process.is_alive():
            _end_process(self.process, 0.5)

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    @property
    def num_generating(self) -> int:
        """Requests in flight whose last delta has not come: the others' handlers have only
        their clients' replies to write (the drain waits for those, a while)."""
        return sum(not handle.finished for handle in self._handles.values())

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every request has ended (or `timeout_s`); True if they all did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._handles and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return not self._handles

    # ---- commands (event loop) --------------------------------------------------------------

    def submit(self, request: Request, entitled: Tier) -> RequestHandle:
        handle = RequestHandle(request)
        rid = request.request_id
        self._handles[rid] = handle
        if not self.running:
            handle.finished = True
            handle.queue.put_nowait(Delta((), True, FinishReason.ABORTED, ENGINE_LOST))
            return handle
        self._note_work()
        self._routes[rid] = handle
        self._submitted[request.tier] += 1
        self._send(AddRequest(request, entitled))
        return handle

    def abort(self, request_id: str) -> None:
        if request_id in self._routes:
            self._send(AbortRequest(request_id))

    def finish(self, request_id: str) -> None:
        """End a request as stopped (a stop string appeared)."""
        if request_id in self._routes:
            self._send(FinishRequest(request_id))

    def close(self, handle: RequestHandle) -> None:
        """The handler is done with `handle`; aborts the request if it is still going."""
        if handle.closed:
            return
        handle.closed = True
        self._handles.pop(handle.request.request_id, None)
        if not handle.finished:
            self.abort(handle.request.request_id)

    def cancel(self, handle: RequestHandle) -> None:
        """The client is gone: wake the handler with a final delta, and abort the request."""
        if handle.closed:
            return
        handle.queue.put_nowait(Delta((), True, FinishReason.ABORTED, "client disconnected"))
        self.close(handle)

    async def inspect(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` in the engine process between two steps (`fn` must pickle by name)."""
        return await self._call(lambda call_id: Inspect(call_id, fn))

    async def metric_families(self) -> list[Metric]:
        """The engine process's metric families, for `/metrics`; none if it does not answer
        within SCRAPE_TIMEOUT_S, or at once while an earlier scrape is still unanswered (a
        stalled engine made every scrape wait the whole timeout, past many Prometheus
        servers' own; the server then shows the last families it had)."""
        if not self.running:
            return []
        if self._scrape is not None and not self._scrape.done():
            return []
        self._scrape = scrape = asyncio.ensure_future(self._call(ScrapeMetrics))
        scrape.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if none waits
        try:
            families: list[Metric] = await asyncio.wait_for(asyncio.shield(scrape), SCRAPE_TIMEOUT_S)
        except (TimeoutError, EngineStartError):
            return []
        return families

    def queued_by_tier(self) -> dict[Tier, int]:
        """Requests not started yet, by tier: the engine's waiting queues plus the pipe."""
        waiting = self.snapshot.waiting
        return {t: waiting.get(t, 0) + self._submitted[t] - self._applied[t] for t in ALL_TIERS}

    def waiting_by_tier(self) -> dict[Tier, int]:
        """Requests the engine's last scheduling pass found no room for, by tier."""
        waiting = self.snapshot.waiting
        return {t: waiting.get(t, 0) for t in ALL_TIERS}

    async def _call(self, make: Callable[[int], Inspect | ScrapeMetrics]) -> Any:
        if self._loop is None or not self.running:
            raise EngineStartError(ENGINE_LOST)
        self._note_work()
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(make(call_id))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    def _note_work(self) -> None:
        """Work is about to be sent: an idle engine's silence starts counting now."""
        if not self._routes and not self._calls:
            self._heard_at = time.monotonic()

    def _send(self, command: Command) -> None:
        if not self.running:
            return
        if not self._outbox and self._loop is not None:
            self._loop.call_soon(self._flush)  # one pipe write for this loop iteration's commands
        self._outbox.append(command)

    def _flush(self) -> None:
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        try:
            self._conn.send(batch)
        except OSError:
            self._on_lost()

    # ---- events (event loop) ----------------------------------------------------------------

    def _on_readable(self) -> None:
        """Apply what the pipe holds, but stop after a step's first tokens: their handlers run
        next, then `FirstsHandled` lets the engine process go on (it waits for it, briefly),
        and only then is the rest of the step read (the pipe stays readable, so the loop
        calls this again)."""
        try:
            while self._conn.poll(0):
                message = self._conn.recv()
                self._heard_at = time.monotonic()
                if isinstance(message, StepOutputs):
                    self._apply(message)
                    if message.firsts and self._loop is not None:
                        # Scheduled after the wake-ups of the handlers just woken: runs after them.
                        self._loop.call_soon(self._firsts_handled, message.returned_at)
                        return
                elif isinstance(message, Answer):
                    self._settle(message)
        except (EOFError, OSError):
            self._on_lost()

    def _apply(self, out: StepOutputs) -> None:
        dispatcher = self._dispatcher
        if dispatcher is None:
            return
        routes = self._routes
        if out.accepted:
            dispatcher.post([(routes[rid], ACCEPTED) for rid in out.accepted if rid in routes])
        if out.firsts:
            self._note_firsts([rid for rid, _ in out.firsts], out)
            dispatcher.post([], [(routes[rid], delta) for rid, delta in out.firsts if rid in routes])
        items = [(routes[rid], Delta(ids)) for rid, ids in out.tokens if rid in routes]
        for rid, delta in out.ends:
            if rid not in routes:
                continue
            if delta.token_ids and rid not in self._started:
                self._note_firsts([rid], out)
            self._started.discard(rid)
            items.append((routes.pop(rid), delta))
        if items:
            dispatcher.post(items)
        if out.snapshot is not None:
            self.snapshot = out.snapshot
        if out.applied is not None:
            self._applied = dict(zip(ALL_TIERS, out.applied, strict=True))
        self.num_step_errors = out.num_step_errors

    def _firsts_handled(self, returned_at: float) -> None:
        self._send(FirstsHandled(returned_at))
        self._flush()  # now, not at the end of this loop iteration: the engine is waiting

    def _note_firsts(self, request_ids: list[str], out: StepOutputs) -> None:
        """First tokens: the admission meter's starts, and the benchmark's in-process TTFT."""
        self._started.update(request_ids)
        self._meter.record(out.returned, len(request_ids))
        trace = self.ttft_trace
        if trace is not None:
            for rid in request_ids:
                handle = self._routes.get(rid)
                if handle is not None:
                    trace[rid] = (out.returned - handle.request.arrival_time, out.returned_at)

    def _settle(self, answer: Answer) -> None:
        future = self._calls.get(answer.call_id)
        if future is None or future.done():
            return
        if answer.error is not None:
            future.set_exception(answer.error)
        else:
            future.set_result(answer.result)

    def _on_lost(self) -> None:
        """The engine process is gone: fail everything in flight, then tell the server."""
        self._stop_reading()
        if self._died or self._stopping:
            return  # reported already, or the exit asked for
        self._died = True
        _end_process(self.process, 1.0)  # a broken pipe to a live engine: it is no use either
        num = len(self._routes)
        log.error(
            "the engine process died (%s); failing %d request%s",
            how_it_ended(self.process.exitcode),
            num,
            "" if num == 1 else "s",
        )
        self._fail_routes(ENGINE_LOST)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineStartError(ENGINE_LOST))
        if self.on_lost is not None:
            self.on_lost()

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        self._reading = False

    def _fail_routes(self, message: str) -> None:
        items = [(h, Delta((), True, FinishReason.ABORTED, message)) for h in self._routes.values()]
        self._routes.clear()
        self._started.clear()
        if items and self._dispatcher is not None:
            self._dispatcher.post(items)


def _end_process(process: BaseProcess, timeout_s: float) -> None:
    """Wait for `process` to exit; kill it if it does not (the engine process ignores SIGTERM,
    which the server's drain is for: a SIGTERM only added 2 s to a hung engine's end)."""
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join(2.0)


def how_it_ended(exitcode: int | None) -> str:
    """A process's exit in words: "killed by SIGKILL" rather than "exit status -9"."""
    if exitcode is None:
        return "not exited yet"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"
