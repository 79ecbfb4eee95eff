"""Drive an engine with a workload in virtual time, closed or open loop.

Requests `[num_warmup, num_warmup + num_measured)` of the stream (by `RequestSpec.index`,
and arriving after `warmup_s`) are measured. Closed loop: `concurrency` clients; when a
client's request ends (or is rejected) it thinks for a random time (exponential with mean
`think_time_s`; 0: not at all) and then sends its next one. Open loop: each spec arrives at
its `arrival_s`. Either way a request arrives at its own instant, which may fall inside a
step: it is handed to the engine at the next step boundary with `arrival_time` = its
arrival, so its TTFT counts the wait for the step in flight. The clock jumps to the next
arrival while the engine is idle. After the measured requests, the
workload keeps flowing (cool-down, not measured) so that the last measured requests see
the same load; the run ends when every measured request has ended, when the stream runs
out, or `drain_timeout_s` after the last measured arrival. Whatever is left is aborted,
and every submitted request must then be final (`UnaccountedError` if not).

A conversation's next turn is sent only once its previous turn has ended: a user cannot
answer a reply they have not read. Until then the turn is held, and the client sends the
next request of the stream instead; a held turn goes out, ahead of the stream, as soon as
its conversation is free (open loop: at that moment, which becomes its arrival).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tierserve.bench.collector import collector_paused
from tierserve.bench.metrics import BlockSampler, RequestRecord, Window
from tierserve.clock import VirtualClock
from tierserve.engine import Engine, EngineStats
from tierserve.request import Request, RequestStatus, SamplingParams
from tierserve.tiers import ALL_TIERS
from tierserve.workloads.spec import RequestSpec

MAX_IDLE_STEPS = 1000  # steps in a row that neither take time nor end a request: the engine is stuck
RUN_ENDED = "still unfinished when the run ended (drain timeout)"
# The same, for a request that had not had its first token: starved, not a long answer.
NEVER_STARTED = "not yet started when the run ended (drain timeout)"
MAX_HELD = 1000  # turns held for a busy conversation at most; then the clients wait
HARD_CAP_FACTOR = 2  # of `max_requests`: the traffic's bound while measured turns are held


class UnaccountedError(RuntimeError):
    """A submitted request has no final record when the run ends."""


@dataclass(frozen=True)
class DriverConfig:
    num_measured: int
    num_warmup: int = 0
    warmup_s: float = 0.0
    concurrency: int | None = 32  # None: open loop (every spec must carry `arrival_s`)
    drain_timeout_s: float = 600.0
    # Cap on submissions once every warm-up and measured request is out (the cool-down's
    # length; default 4 x (warm-up + measured)). While a turn of those is still held for its
    # conversation the traffic flows on, so that it meets the load the others met, up to
    # HARD_CAP_FACTOR (2) times the cap; past that only those turns are still sent.
    max_requests: int | None = None
    think_time_s: float = 0.0  # closed loop: mean of a client's exponential think time
    seed: int = 0  # of the think times

    def __post_init__(self) -> None:
        if self.num_measured < 1 or self.num_warmup < 0:
            raise ValueError("need num_measured >= 1 and num_warmup >= 0")
        if not self.think_time_s >= 0:
            raise ValueError(f"think_time_s must be >= 0, got {self.think_time_s}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def is_measured(self, spec: RequestSpec, arrival_s: float) -> bool:
        return (
            self.num_warmup <= spec.index < self.num_warmup + self.num_measured and arrival_s >= self.warmup_s
        )


@dataclass(frozen=True)
class DriverResult:
    records: list[RequestRecord]  # every submitted request, final, in submission order
    window: Window
    stats: EngineStats
    end_s: float


class _Run:
    def __init__(
        self, engine: Engine, clock: VirtualClock, specs: Iterable[RequestSpec], config: DriverConfig
    ) -> None:
        self.engine, self.clock, self.config = engine, clock, config
        self.specs: Iterator[RequestSpec] = iter(specs)
        self.next_spec: RequestSpec | None = next(self.specs, None)
        self.max_requests = config.max_requests or 4 * (config.num_warmup + config.num_measured)
        # request id -> (request, index, measured, the workload's own arrival time)
        self.live: dict[str, tuple[Request, int, bool, float | None]] = {}
        self.records: list[RequestRecord] = []
        self.num_submitted = 0
        self.num_measured_live = 0
        self.last_turn: dict[str, Request] = {}  # conversation id -> its latest request
        self.held: list[RequestSpec] = []  # turns whose conversation's previous turn is live, by index
        self.sampler = BlockSampler()
        self.start: tuple[float, int, float, float] | None = None  # (time, tokens, roofline, busy)
        self.window: Window | None = None
        self.deadline = math.inf
        self.think_rng = np.random.default_rng([config.seed, 0x7D1C])
        # Closed loop: the instant each idle client sends its next request (a min-heap);
        # clients with a request in the engine are not in it.
        self.ready: list[float] = []
        if config.concurrency is not None:
            self.ready = sorted(self._think(0.0) for _ in range(config.concurrency))

    def _think(self, now: float) -> float:
        mean = self.config.think_time_s
        return now + float(self.think_rng.exponential(mean)) if mean > 0 else now

    def _next_arrival(self) -> float | None:
        """When the next request arrives (None: none will until a live one ends)."""
        if self.config.concurrency is not None:
            return self.ready[0] if self.ready else None
        return self.next_spec.arrival_s if self.next_spec is not None else None

    # ---- submission ----------------------------------------------------------------------

    def _all_measured_submitted(self) -> bool:
        end = self.config.num_warmup + self.config.num_measured
        return (self.next_spec is None or self.next_spec.index >= end) and not any(
            spec.index < end for spec in self.held
        )

    def _capped(self) -> bool:
        """Past the hard cap: only warm-up and measured requests are still sent (a turn
        held for its conversation is one, and leaving it out would drop the slow ones)."""
        return self.num_submitted >= HARD_CAP_FACTOR * self.max_requests

    def _may_submit(self) -> bool:
        if self.next_spec is None and not self.held:
            return False
        if self.num_submitted >= self.max_requests and self._all_measured_submitted():
            return False
        return not (
            self._all_measured_submitted() and self.num_measured_live == 0 and self.window is not None
        )

    def _conversation_busy(self, spec: RequestSpec) -> bool:
        if spec.conversation_id is None:
            return False
        previous = self.last_turn.get(spec.conversation_id)
        return previous is not None and not previous.status.is_final

    def _take_next(self) -> tuple[RequestSpec, bool] | None:
        """(the next request to send, whether it was held): a held turn whose conversation
        is free, else the stream's next spec (holding any turn of a busy conversation on the
        way); None if the stream's next spec has not arrived yet (open loop) or none is left."""
        end = self.config.num_warmup + self.config.num_measured if self._capped() else math.inf
        for i, spec in enumerate(self.held):
            if spec.index < end and not self._conversation_busy(spec):
                return self.held.pop(i), True
        while self.next_spec is not None and self.next_spec.index < end:
            spec = self.next_spec
            open_loop = self.config.concurrency is None
            if open_loop and (spec.arrival_s is None or spec.arrival_s > self.clock.now()):
                return None
            if not self._conversation_busy(spec):
                self._advance()
                return spec, False
            if len(self.held) >= MAX_HELD:
                return None  # the clients wait for a conversation to come free
            self.held.append(spec)
            self._advance()
        return None

    def _advance(self) -> None:
        self.next_spec = next(self.specs, None)

    def _answered_s(self, spec: RequestSpec) -> float:
        previous = self.last_turn.get(spec.conversation_id) if spec.conversation_id else None
        if previous is None or previous.finish_time is None:
            return -math.inf
        return previous.finish_time

    def _prompt(self, spec: RequestSpec) -> Sequence[int]:
        """The spec's prompt, with the previous turn's real answer in place of the stand-in."""
        if spec.conversation_id is None:
            return spec.prompt_token_ids
        prompt = list(spec.prompt_token_ids)
        previous = self.last_turn.get(spec.conversation_id)
        if (
            spec.num_history_tokens
            and previous is not None
            and previous.status is RequestStatus.FINISHED
            and previous.num_tokens == spec.num_history_tokens
        ):
            prompt[: spec.num_history_tokens] = previous.token_ids
        return prompt

    def _submit(self, spec: RequestSpec, held: bool) -> None:
        now = self.clock.now()
        if self.config.concurrency is not None:
            # A client idle since before the conversation's previous answer sends the turn
            # once it has read that answer.
            arrival: float | None = max(heapq.heappop(self.ready), self._answered_s(spec))
        else:
            arrival = now if held else spec.arrival_s
        if arrival is None:
            raise ValueError(f"open loop: spec {spec.index} has no arrival time")
        req = Request(
            f"r{spec.index}",
            self._prompt(spec),
            SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True),
            tier=spec.tier,
            tenant=spec.tenant,
            arrival_time=arrival,
        )
        measured = self.config.is_measured(spec, arrival)
        scheduled = spec.arrival_s if self.config.concurrency is None else None
        if measured and self.start is None:
            s = self.engine.stats
            self.start = (now, s.num_generated_tokens, s.roofline_s, s.busy_s)
        if spec.conversation_id is not None:
            self.last_turn[spec.conversation_id] = req
        self.num_submitted += 1
        if self._all_measured_submitted() and math.isinf(self.deadline):
            self.deadline = now + self.config.drain_timeout_s
        if self.engine.add_request(req):
            self.live[req.request_id] = (req, spec.index, measured, scheduled)
            self.num_measured_live += measured
        else:
            self.records.append(RequestRecord.of(req, spec.index, measured, scheduled_s=scheduled))
            self._client_free(now)

    def _client_free(self, now: float) -> None:
        if self.config.concurrency is not None:
            heapq.heappush(self.ready, self._think(now))

    def _submit_due(self) -> None:
        closed = self.config.concurrency is not None
        while self._may_submit():
            if closed and not (self.ready and self.ready[0] <= self.clock.now()):
                return
            taken = self._take_next()
            if taken is None:
                return
            self._submit(*taken)

    # ---- stepping ------------------------------------------------------------------------

    def _end(self, req: Request, reason: str = "") -> None:
        _, index, measured, scheduled = self.live.pop(req.request_id)
        self.records.append(RequestRecord.of(req, index, measured, reason, scheduled))
        self.num_measured_live -= measured
        self._client_free(self.clock.now())

    def _sampling(self) -> bool:
        return self.start is not None and self.window is None

    def _sample(self, duration_s: float) -> None:
        """Note a leapt step as it begins: the blocks held and the time it will take on
        the clock (computed as `_step` finds it, to the bit)."""
        memory = self.engine.memory
        used = [memory.used_blocks(t) for t in ALL_TIERS]
        borrowed = memory.borrowed_by_tier()
        now = self.clock.now()
        self.sampler.add((now + duration_s) - now, used, borrowed)

    def _window_closes(self) -> bool:
        """Whether the loop closes the measurement window at its next turn: every measured
        request sent and none live (the last may have been rejected on arrival)."""
        return self.start is not None and self._all_measured_submitted() and self.num_measured_live == 0

    def _leap(self) -> bool:
        """Fast simulation: the steps before the next arrival (or the drain deadline), up
        to the first in which requests end, at once; False if there were none (the next
        must be a `_step`). No leap while the window is about to close: the loop runs one
        more step, then stops."""
        if self._window_closes():
            return False
        arrival = self._next_arrival() if self._may_submit() else None
        until = min(math.inf if arrival is None else arrival, self.deadline)
        leapt = self.engine.leap(until, self._sample if self._sampling() else None)
        for output in leapt.ended:
            self._end(output.request)
        return leapt.num_steps > 0

    def _step(self) -> bool:
        """One engine step; False if it neither took time nor ended a request."""
        if self._leap():
            return True
        # The blocks held as the step begins, noted while the window samples (only this
        # driver opens and closes it, never a step).
        sampling = self._sampling()
        if sampling:
            memory = self.engine.memory
            used = [memory.used_blocks(t) for t in ALL_TIERS]
            borrowed = memory.borrowed_by_tier()
        before = self.clock.now()
        outputs = self.engine.step()
        if sampling:
            self.sampler.add(self.clock.now() - before, used, borrowed)
        ended = [o.request for o in outputs if o.finished]
        for req in ended:
            self._end(req)
        return self.clock.now() > before or bool(ended)

    def _close_window(self) -> None:
        if self.window is not None:
            return
        s = self.engine.stats
        t0, tokens0, roofline0, busy0 = self.start or (
            self.clock.now(),
            s.num_generated_tokens,
            s.roofline_s,
            s.busy_s,
        )
        self.window = Window(
            t0,
            self.clock.now(),
            s.num_generated_tokens - tokens0,
            s.roofline_s - roofline0,
            s.busy_s - busy0,
            self.sampler.usage(),
            self.sampler.peak_total,
        )

    def run(self) -> DriverResult:
        num_idle = 0
        while True:
            if self._window_closes():
                self._close_window()
            self._submit_due()
            if self.window is not None or self.clock.now() >= self.deadline:
                break
            if self.engine.has_unfinished():
                num_idle = 0 if self._step() else num_idle + 1
                if num_idle > MAX_IDLE_STEPS:
                    raise RuntimeError(
                        f"engine made no progress in {MAX_IDLE_STEPS} steps with "
                        f"{len(self.live)} requests live"
                    )
            elif self._may_submit() and (arrival := self._next_arrival()) is not None:
                if arrival <= self.clock.now():
                    break  # an arrival is due but nothing can be sent: the stream is held up
                self.clock.advance_to(arrival)
            else:
                break
        self._close_window()
        for request_id in list(self.live):
            req = self.live[request_id][0]
            self.engine.abort(request_id)
            self._end(req, RUN_ENDED if req.first_token_time is not None else NEVER_STARTED)
        unaccounted = [r.request_id for r in self.records if not r.status.is_final]
        if unaccounted or self.engine.has_unfinished() or len(self.records) != self.num_submitted:
            raise UnaccountedError(f"requests not accounted for: {unaccounted}")
        if self.window is None:
            raise UnaccountedError("the measurement window never closed")
        return DriverResult(self.records, self.window, self.engine.stats, self.clock.now())


def run_workload(
    engine: Engine, clock: VirtualClock, specs: Iterable[RequestSpec], config: DriverConfig
) -> DriverResult:
    """Run `specs` through `engine` (which must run on `clock`) as `config` says, with the
    cyclic garbage collector paused (bench/collector.py)."""
    with collector_paused():
        return _Run(engine, clock, specs, config).run()
