"""The engine process: builds the engine from an `EngineRecipe` and runs its step loop.

Started by `EngineClient` (engine_client.py) with multiprocessing's spawn context. A
reader thread takes command lists off the pipe into an inbox; the main thread applies
the inbox between steps (so an abort frees the request's blocks before the next step),
runs `Engine.step()`, sends the step's first tokens at once in a message of their own
(urgent tiers first), waits briefly until the server has sent them on (handoff.py), then
sends the rest of the step's tokens and ends with a snapshot of the engine's state, and
only then records its own metrics. The server's HTTP work never runs in this process:
it delays a step only by that bounded wait.

The process ignores SIGINT and SIGTERM: the server drains first and then sends
`Shutdown` (or closes the pipe, which stops the loop the same way).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tierserve.clock import WallClock
from tierserve.engine import Engine, RequestOutput
from tierserve.request import FinishReason, Request
from tierserve.server.backends import BackendError
from tierserve.server.engine_messages import (
    AbortRequest,
    AddRequest,
    Answer,
    BetweenSteps,
    Command,
    EngineFailed,
    EngineReady,
    EngineRecipe,
    FirstsHandled,
    Inspect,
    ScrapeMetrics,
    Shutdown,
    StepOutputs,
)
from tierserve.server.handoff import Handoff
from tierserve.server.metrics import ServerMetrics
from tierserve.server.served_executor import ServedExecutor
from tierserve.server.state_metrics import snapshot_of
from tierserve.server.streams import Delta
from tierserve.tiers import ALL_TIERS, Tier

log = logging.getLogger("tierserve.engine")
IDLE_WAIT_S = 0.05


@dataclass(slots=True)
class _Live:
    request: Request
    entitled: Tier
    last_token_time: float | None = None


def engine_main(recipe: EngineRecipe, conn: Connection) -> None:
    """The engine process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=recipe.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        core = EngineCore.build(recipe, conn)
    except BackendError as e:  # a bad --model, --gpu, --device: the server prints it
        conn.send(EngineFailed(str(e), bad_setting=True))
        return
    except Exception as e:
        log.exception("the engine could not be built")
        conn.send(EngineFailed(f"the engine could not be built: {type(e).__name__}: {e}"))
        return
    gc.collect()
    gc.freeze()  # the model and the block pool: no collection walks them again
    core.run()


class EngineCore:
    def __init__(self, engine: Engine, metrics: ServerMetrics, conn: Connection) -> None:
        self.engine = engine
        self._metrics = metrics
        self._conn = conn
        self._inbox: deque[BetweenSteps] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._handoff = Handoff()
        self._live: dict[str, _Live] = {}
        self._applied = dict.fromkeys(ALL_TIERS, 0)
        self._num_step_errors = 0
        self._idle_reported = False

    @classmethod
    def build(cls, recipe: EngineRecipe, conn: Connection) -> EngineCore:
        backend = recipe.backend()
        metrics = ServerMetrics(backend.model_name, recipe.ttft_targets)
        served = ServedExecutor(backend.executor, metrics.swap, pace=backend.pace)
        engine = Engine(recipe.engine_config, recipe.policy, served, WallClock(recipe.clock_origin))
        spec = backend.executor.spec
        conn.send(
            EngineReady(
                pid=os.getpid(),
                model_name=backend.model_name,
                vocab_size=backend.vocab_size,
                max_model_len=spec.max_model_len,
                block_size=spec.block_size,
                ceiling_blocks={t: engine.memory.partition.ceiling[t] for t in ALL_TIERS},
                tokenizer=backend.tokenizer,
                context_note=spec.context_note,
                sampling_defaults=spec.sampling_defaults,
            )
        )
        return cls(engine, metrics, conn)

    # ---- the pipe ---------------------------------------------------------------------------

    def _read(self) -> None:
        """Reader thread: command lists off the pipe into the inbox, until Shutdown or EOF.
        `FirstsHandled` goes to the handoff at once: the step loop may be waiting for it."""
        try:
            while not self._stop.is_set():
                commands: list[Command] = self._conn.recv()
                for command in commands:
                    if isinstance(command, FirstsHandled):
                        self._handoff.handled(command.returned_at)
                    else:
                        self._inbox.append(command)
                self._wake.set()
        except (EOFError, OSError):
            self._inbox.append(Shutdown())  # the server is gone: stop the same way
            self._wake.set()

    def _send(self, message: StepOutputs | Answer) -> None:
        try:
            self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._stop.set()  # nobody listens any more

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self._read, name="tierserve-engine-reader", daemon=True).start()
        engine = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            self._apply_inbox()
            if self._stop.is_set():
                break
            if not engine.has_unfinished():
                if not self._idle_reported:  # the last step's snapshot may predate the aborts
                    self._send(self._state_message(StepOutputs()))
                    self._idle_reported = True
                self._wake.wait(IDLE_WAIT_S)
                continue
            self._idle_reported = False
            try:
                outputs = engine.step()
            except Exception:  # a bug below must not take the server down with it
                log.exception("engine step failed; failing its requests")
                self._num_step_errors += 1
                self._fail_all("internal engine error")
                continue
            self._deliver(outputs, time.monotonic(), engine.clock.now())
        self._fail_all("server shutting down")
        log.info("engine process exiting")

    def _apply_inbox(self) -> None:
        out = StepOutputs()
        while self._inbox:
            cmd = self._inbox.popleft()
            if isinstance(cmd, AddRequest):
                self._add(cmd, out)
            elif isinstance(cmd, Inspect | ScrapeMetrics):
                self._answer(cmd)
            elif isinstance(cmd, Shutdown):
                self._stop.set()
            else:
                live = self._live.get(cmd.request_id)
                if live is None:
                    continue
                aborted = isinstance(cmd, AbortRequest)
                ended = self.engine.abort(cmd.request_id) if aborted else self.engine.finish(cmd.request_id)
                if ended:
                    self._account_end(live, live.request)
                    out.ends.append((cmd.request_id, final_delta(live.request, [])))
        if out.accepted or out.ends:
            # No snapshot here: the state a scrape reads is the one the last step left. Its
            # waiting requests are those the scheduling pass found no room for, as vLLM
            # counts them; ones that came in since wait only for the step boundary, and a
            # gateway reading them as a queue held streams back from an idle replica.
            # (Admission still counts them: they are submitted and not yet applied.)
            self._send(out)
            self._idle_reported = False  # so that an engine left idle still sends its state

    def _add(self, cmd: AddRequest, out: StepOutputs) -> None:
        req = cmd.request
        self._applied[req.tier] += 1
        if self.engine.add_request(req):
            self._live[req.request_id] = _Live(req, cmd.entitled)
            out.accepted.append(req.request_id)
        else:
            self._metrics.reject("engine_refused", req.tier)
            out.ends.append((req.request_id, Delta((), True, FinishReason.REJECTED, req.reject_reason)))

    def _answer(self, cmd: Inspect | ScrapeMetrics) -> None:
        try:
            result = (
                cmd.fn(self.engine) if isinstance(cmd, Inspect) else list(self._metrics.registry.collect())
            )
        except Exception as e:
            self._send(Answer(cmd.call_id, error=e))
        else:
            self._send(Answer(cmd.call_id, result))

    def _deliver(self, outputs: list[RequestOutput], returned_at: float, returned: float) -> None:
        """Send the step's first tokens at once, wait until the server has sent them on, then
        send the step's other tokens and ends, then account."""
        firsts = self._firsts(outputs)
        if firsts:
            self._send(StepOutputs(firsts=firsts, returned_at=returned_at, returned=returned))
            self._handoff.wait(returned_at, len(firsts))
        live_by_id = self._live
        seen: list[tuple[RequestOutput, _Live]] = []
        tokens: list[tuple[Tier, str, tuple[int, ...]]] = []
        ends: list[tuple[Tier, str, Delta]] = []
        for out in outputs:
            live = live_by_id.get(out.request.request_id)
            if live is None:
                continue
            seen.append((out, live))
            rid, ids = out.request.request_id, out.new_token_ids
            if out.finished:
                ends.append((live.request.tier, rid, final_delta(out.request, ids)))
            elif ids and live.last_token_time is not None:  # not a first token: sent already
                tokens.append((live.request.tier, rid, tuple(ids)))
        tokens.sort(key=_tier_key)
        ends.sort(key=_tier_key)
        rest = StepOutputs(
            tokens=[(r, i) for _, r, i in tokens],
            ends=[(r, d) for _, r, d in ends],
            returned_at=returned_at,
            returned=returned,
        )
        self._account(seen)
        self._send(self._state_message(rest))

    def _firsts(self, outputs: list[RequestOutput]) -> list[tuple[str, Delta]]:
        """The first tokens of requests that go on, urgent tiers first: only what they need is
        done before they are sent (a request that ends with its first token ends with the rest).
        They carry the prompt tokens found cached: a request the server ends at a stop string
        reads no final delta."""
        live_by_id = self._live
        firsts: list[tuple[Tier, str, Delta]] = []
        for out in outputs:
            if out.finished or not out.new_token_ids:
                continue
            req = out.request
            live = live_by_id.get(req.request_id)
            if live is not None and live.last_token_time is None:
                delta = Delta(tuple(out.new_token_ids), num_cached_tokens=req.num_cached_tokens)
                firsts.append((req.tier, req.request_id, delta))
        firsts.sort(key=_tier_key)
        return [(rid, delta) for _, rid, delta in firsts]

    def _state_message(self, out: StepOutputs) -> StepOutputs:
        out.snapshot = snapshot_of(self.engine)
        out.applied = tuple(self._applied[t] for t in ALL_TIERS)
        out.num_step_errors = self._num_step_errors
        return out

    def _account(self, seen: list[tuple[RequestOutput, _Live]]) -> None:
        # `vllm:generation_tokens` is the server's count (GenerationRun): the tokens made past
        # a stop string before the server's `finish` arrives are no client's.
        now = self.engine.clock.now()
        for out, live in seen:
            req = out.request
            n = len(out.new_token_ids)
            if n:
                if live.last_token_time is None:
                    ttft = (req.first_token_time or now) - req.arrival_time
                    self._metrics.observe_first_token(req.tier, ttft, req.num_prompt_tokens)
                else:
                    self._metrics.itl.observe((now - live.last_token_time) / n)
                live.last_token_time = now
            if out.finished:
                self._account_end(live, req)

    def _account_end(self, live: _Live, req: Request) -> None:
        del self._live[req.request_id]
        reason = req.finish_reason or FinishReason.ABORTED
        end = req.finish_time if req.finish_time is not None else self.engine.clock.now()
        self._metrics.observe_finished(
            req.tier, live.entitled, req.ttft_s, end - req.arrival_time, reason.value
        )

    def _fail_all(self, message: str) -> None:
        """End every live request as aborted (a failed step, or shutting down), counted in
        the finished-requests metrics like any other end."""
        out = StepOutputs()
        for request_id, live in list(self._live.items()):
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("abort of %s failed", request_id)
            req = live.request
            if req.finish_reason is None:  # the abort did not get as far as ending it
                req.finish_reason = FinishReason.ABORTED
            self._account_end(live, req)
            out.ends.append((request_id, Delta((), True, FinishReason.ABORTED, message)))
        self._live.clear()
        if out.ends and not self._conn.closed:
            self._send(self._state_message(out))


def _tier_key(item: tuple[Tier, str, object]) -> Tier:
    return item[0]


def final_delta(req: Request, new_token_ids: list[int]) -> Delta:
    """The last delta of `req`: its last tokens, how it ended and its usage."""
    return Delta(
        tuple(new_token_ids),
        True,
        req.finish_reason or FinishReason.ABORTED,
        req.reject_reason if req.finish_reason is FinishReason.SHED else "",
        req.num_prompt_tokens,
        req.num_cached_tokens,
        req.num_output_tokens,
    )
