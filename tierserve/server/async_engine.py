"""The engine loop in its own thread, and per-request streams for the asyncio handlers.

The event loop never calls the engine. Handlers put commands (add, abort, finish) in a
thread-safe inbox; the engine thread applies them between steps, so an abort frees the
request's blocks before the next step starts. After each step the engine thread hands
the step's first tokens to the event loop (`call_soon_threadsafe`), waits (briefly) until
the loop has sent them, then hands over the step's other tokens and only then does its own
bookkeeping (metrics, and an `EngineSnapshot` that the event loop reads for admission and
metrics): a first token never waits for interpreter time spent on accounting. Only the engine
thread touches the engine and `_live`.

Each step's deliveries are ordered (first tokens ahead of everything still queued, urgent
tiers first) and handed to the `Dispatcher` (see `streams.py`), which wakes handlers a
slice at a time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierserve.engine import Engine, RequestOutput
from tierserve.request import FinishReason, Request
from tierserve.server.admission import ThroughputMeter
from tierserve.server.metrics import ServerMetrics
from tierserve.server.state_metrics import EngineSnapshot, snapshot_of
from tierserve.server.streams import ACCEPTED, Delta, Dispatcher, RequestHandle, tier_of
from tierserve.tiers import ALL_TIERS, Tier

log = logging.getLogger("tierserve.server")

# The most a step waits for the event loop to send its first tokens: a base plus a share per
# first token (sending one takes the loop ~0.1 ms here), capped.
HANDOFF_WAIT_S = 0.001
HANDOFF_WAIT_PER_FIRST_S = 0.0002
HANDOFF_WAIT_MAX_S = 0.010


@dataclass(slots=True)
class _Live:
    handle: RequestHandle
    entitled: Tier
    last_token_time: float | None = None


@dataclass(frozen=True, slots=True)
class _Command:
    kind: str  # "add" | "abort" | "finish" | "call"
    request_id: str = ""
    live: _Live | None = None
    call: Callable[[Engine], Any] | None = None
    future: asyncio.Future[Any] | None = None


class AsyncEngine:
    def __init__(
        self, engine: Engine, *, metrics: ServerMetrics, meter: ThroughputMeter, idle_wait_s: float = 0.05
    ) -> None:
        self.engine = engine
        self._metrics = metrics
        self._meter = meter
        self._idle_wait_s = idle_wait_s
        self._inbox: deque[_Command] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dispatcher: Dispatcher | None = None
        self._handoff = threading.Event()  # set by the event loop once the posted first tokens are sent
        self._live: dict[str, _Live] = {}  # engine thread only
        self._handles: dict[str, RequestHandle] = {}  # event loop only: requests not yet closed
        self._submitted = dict.fromkeys(ALL_TIERS, 0)  # written by the event loop only
        self._applied = dict.fromkeys(ALL_TIERS, 0)  # written by the engine thread only
        self.snapshot = EngineSnapshot()
        self.num_step_errors = 0
        # Set to a dict to record, by request id, the in-process TTFT (arrival -> return of the
        # `Engine.step()` that produced the first token: what a caller of the engine sees) and
        # the `time.monotonic()` of that return. The serve benchmark compares them with HTTP.
        self.ttft_trace: dict[str, tuple[float, float]] | None = None

    # ---- lifecycle (event loop) -----------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._dispatcher = Dispatcher(self._loop, self._handoff)
        self._take_snapshot()
        self._thread = threading.Thread(target=self._run, name="tierserve-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    async def stop(self) -> None:
        """Abort what is left and stop the thread."""
        for request_id in list(self._handles):
            self.abort(request_id)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every request has ended (or `timeout_s`); True if they all did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._handles and loop.time() < deadline:
            await asyncio.sleep(0.02)
        return not self._handles

    # ---- commands (event loop) ------------------------------------------------------------

    def submit(self, request: Request, entitled: Tier) -> RequestHandle:
        handle = RequestHandle(request)
        self._handles[request.request_id] = handle
        self._submitted[request.tier] += 1
        self._send(_Command("add", request.request_id, _Live(handle, entitled)))
        return handle

    def abort(self, request_id: str) -> None:
        self._send(_Command("abort", request_id))

    def finish(self, request_id: str) -> None:
        """End a request as stopped (a stop string appeared)."""
        self._send(_Command("finish", request_id))

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
        """Run `fn(engine)` on the engine thread between two steps and return its result."""
        assert self._loop is not None, "start() first"
        future: asyncio.Future[Any] = self._loop.create_future()
        self._send(_Command("call", call=fn, future=future))
        return await future

    def queued_by_tier(self) -> dict[Tier, int]:
        """Requests not started yet, by tier: the engine's waiting queues plus the inbox."""
        waiting = self.snapshot.waiting
        return {t: waiting.get(t, 0) + self._submitted[t] - self._applied[t] for t in ALL_TIERS}

    def _send(self, command: _Command) -> None:
        self._inbox.append(command)
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            self._apply_inbox()
            if not engine.has_unfinished():
                self._take_snapshot()
                self._wake.wait(self._idle_wait_s)
                continue
            try:
                outputs = engine.step()
            except Exception:  # a bug below must not take the server down with it
                log.exception("engine step failed; failing its requests")
                self.num_step_errors += 1
                self._fail_all("internal engine error")
                continue
            returned_at, returned = time.monotonic(), engine.clock.now()
            firsts = self._deliver_firsts(outputs)
            if firsts:
                # Let the event loop send the first tokens before this thread's work (the rest of
                # the step's tokens, metrics, the next step) competes with it for the
                # interpreter lock. Bounded: the engine never waits long.
                self._handoff.wait(
                    min(HANDOFF_WAIT_S + HANDOFF_WAIT_PER_FIRST_S * len(firsts), HANDOFF_WAIT_MAX_S)
                )
            seen = self._live_outputs(outputs)
            self._deliver_rest(seen, firsts)
            if self.ttft_trace is not None:
                self._trace(seen, returned_at, returned)
            self._account(seen)
            self._take_snapshot()
        self._apply_inbox()
        self._fail_all("server shutting down")

    def _apply_inbox(self) -> None:
        engine = self.engine
        accepted: list[tuple[RequestHandle, Delta]] = []
        while self._inbox:
            cmd = self._inbox.popleft()
            if cmd.kind == "add":
                assert cmd.live is not None
                req = cmd.live.handle.request
                self._applied[req.tier] += 1
                if engine.add_request(req):
                    self._live[req.request_id] = cmd.live
                    accepted.append((cmd.live.handle, ACCEPTED))
                else:
                    self._metrics.reject("engine_refused", req.tier)
                    self._post([(cmd.live.handle, Delta((), True, FinishReason.REJECTED, req.reject_reason))])
                continue
            if cmd.kind == "call":
                assert cmd.call is not None and cmd.future is not None
                self._answer(cmd.future, cmd.call)
                continue
            live = self._live.get(cmd.request_id)
            if live is None:
                continue
            ended = engine.abort(cmd.request_id) if cmd.kind == "abort" else engine.finish(cmd.request_id)
            if ended:
                self._end(live, live.handle.request)
        # The handlers may commit their responses' status lines now, while the engine prefills.
        self._post(accepted)

    def _answer(self, future: asyncio.Future[Any], fn: Callable[[Engine], Any]) -> None:
        loop = self._loop
        assert loop is not None
        try:
            result = fn(self.engine)
        except Exception as e:
            loop.call_soon_threadsafe(_settle, future, None, e)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    def _deliver_firsts(self, outputs: list[RequestOutput]) -> set[str]:
        """Post the step's first tokens (urgent tiers first) ahead of everything queued; return
        their request ids. Quick: the step's other outputs are looked at after the hand-off."""
        firsts: list[tuple[RequestHandle, Delta]] = []
        live_by_id = self._live
        for out in outputs:
            ids, req = out.new_token_ids, out.request
            # Its only output tokens are this step's: cheap to test for a few hundred outputs.
            if ids and not out.finished and len(req.token_ids) - req.num_prompt_tokens == len(ids):
                live = live_by_id.get(req.request_id)
                if live is not None and live.last_token_time is None:
                    firsts.append((live.handle, Delta(tuple(ids))))
        self._handoff.clear()
        if not firsts:
            return set()
        firsts.sort(key=tier_of)
        self._post([], firsts)
        return {handle.request.request_id for handle, _ in firsts}

    def _live_outputs(self, outputs: list[RequestOutput]) -> list[tuple[RequestOutput, _Live]]:
        """The step's outputs that belong to requests this server is still serving."""
        live_by_id = self._live
        seen = []
        for out in outputs:
            live = live_by_id.get(out.request.request_id)
            if live is not None:
                seen.append((out, live))
        return seen

    def _deliver_rest(self, seen: list[tuple[RequestOutput, _Live]], firsts: set[str]) -> None:
        """Post the step's tokens other than the `firsts` already posted, and its ends, urgent
        tiers first."""
        items: list[tuple[RequestHandle, Delta]] = []
        for out, live in seen:
            if out.finished:
                items.append((live.handle, _final_delta(out.request, out.new_token_ids)))
            elif out.new_token_ids and out.request.request_id not in firsts:
                items.append((live.handle, Delta(tuple(out.new_token_ids))))
        items.sort(key=tier_of)
        self._post(items)

    def _trace(self, seen: list[tuple[RequestOutput, _Live]], returned_at: float, returned: float) -> None:
        """Record first tokens in `ttft_trace`; `step()` returned at `returned_at`
        (`time.monotonic()`), `returned` on the engine's clock."""
        assert self.ttft_trace is not None
        for out, live in seen:
            if live.last_token_time is None and out.new_token_ids:
                ttft = returned - out.request.arrival_time
                self.ttft_trace[out.request.request_id] = (ttft, returned_at)

    def _account(self, seen: list[tuple[RequestOutput, _Live]]) -> None:
        """Metrics and per-request bookkeeping for the outputs of a step (after its tokens are
        out: for ~200 requests this is a millisecond or two of interpreter time)."""
        now = self.engine.clock.now()
        generated = 0
        for out, live in seen:
            req = out.request
            n = len(out.new_token_ids)
            if n:
                generated += n
                if live.last_token_time is None:
                    assert req.first_token_time is not None
                    ttft = req.first_token_time - req.arrival_time
                    self._metrics.observe_first_token(req.tier, ttft, req.num_prompt_tokens)
                    self._meter.record(now)
                else:
                    self._metrics.itl.observe((now - live.last_token_time) / n)
                live.last_token_time = now
            if out.finished:
                self._account_end(live, req)
        if generated:
            self._metrics.generation_tokens.inc(generated)

    def _end(self, live: _Live, req: Request) -> None:
        """The engine ended `req` outside a step (abort, finish): account for it and tell its handler."""
        self._account_end(live, req)
        self._post([(live.handle, _final_delta(req, []))])

    def _account_end(self, live: _Live, req: Request) -> None:
        del self._live[req.request_id]
        reason = req.finish_reason or FinishReason.ABORTED
        end = req.finish_time if req.finish_time is not None else self.engine.clock.now()
        self._metrics.observe_finished(
            req.tier, live.entitled, req.ttft_s, end - req.arrival_time, reason.value
        )

    def _fail_all(self, message: str) -> None:
        items = []
        for request_id, live in list(self._live.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
            items.append((live.handle, Delta((), True, FinishReason.ABORTED, message)))
        self._live.clear()
        self._post(items)

    def _post(
        self, items: list[tuple[RequestHandle, Delta]], firsts: Sequence[tuple[RequestHandle, Delta]] = ()
    ) -> None:
        loop, dispatcher = self._loop, self._dispatcher
        if (items or firsts) and loop is not None and dispatcher is not None and not loop.is_closed():
            loop.call_soon_threadsafe(dispatcher.post, items, firsts)

    def _take_snapshot(self) -> None:
        self.snapshot = snapshot_of(self.engine)


def _final_delta(req: Request, new_token_ids: list[int]) -> Delta:
    return Delta(
        tuple(new_token_ids),
        True,
        req.finish_reason or FinishReason.ABORTED,
        req.reject_reason if req.finish_reason is FinishReason.SHED else "",
        req.num_prompt_tokens,
        req.num_cached_tokens,
        req.num_output_tokens,
    )


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
