"""Flow control: while every upstream is saturated, requests wait here in tier queues.

The queues are a tierserve scheduling policy (hybrid by default, with its aging and
SLO rescue), so the gateway releases requests in the order the engine would admit them.
Each model has queues of its own (`model`: the dispatcher passes its group of models that
share upstreams, `DispatchCore.group`): a request waits only behind requests for its model
(one queue for all let a backlog on one model hold another's requests while that model's
upstreams sat idle, P0 included, until the backlog drained or they timed out). Across
models the most urgent head goes first (tier, then time queued). Each tier has a cap on
its queue length, per model, and on the time a request may wait. A request refused
because its tier's queue is full gets a `retry_after` of the queue ahead of it divided by
the measured drain rate (requests the fleet finished per second recently).

Plain state on an injected clock, no I/O: the gateway's dispatcher calls `offer`,
`release` and `expire`; a fleet simulation can call the same in virtual time.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.request import Request, SamplingParams
from tierserve.scheduling import Policy, create_policy
from tierserve.server.admission import ThroughputMeter
from tierserve.tiers import ALL_TIERS, Tier

DEFAULT_RETRY_S = 1.0  # the least retry_after said while the drain rate is not known
MAX_UNKNOWN_RETRY_S = 60.0  # the most, for a tier without a wait cap
MAX_IDLE_QUEUES = 64  # past this many models' queues, the empty ones are let go


@dataclass(frozen=True, slots=True)
class Refusal:
    tier: Tier
    queue_depth: int
    retry_after_s: float


class FlowControl:
    def __init__(
        self,
        engine_config: EngineConfig,
        policy: str,
        queue_caps: Mapping[Tier, int],
        max_wait_s: Mapping[Tier, float],
        clock: Clock,
        drain_meter: ThroughputMeter | None = None,
    ) -> None:
        self._engine_config = engine_config
        self._policy_name = policy
        create_policy(policy, engine_config)  # an unknown name fails here, not at the first wait
        self._queues: dict[str, Policy] = {}  # by model
        self._model_of: dict[str, str] = {}  # ticket id -> its model, while it waits
        self._caps = {t: queue_caps[t] for t in ALL_TIERS}
        self._max_wait = {t: max_wait_s[t] for t in ALL_TIERS}
        self._clock = clock
        self._meter = drain_meter or ThroughputMeter()
        self._ids = itertools.count()
        self._joins = itertools.count()  # breaks ties in `_oldest_first`
        # Each tier's tickets by the time they joined (a retried request keeps its place),
        # for `expire`: the oldest are the first to run out of time. Tickets that left the
        # queue are dropped when they reach the top. Tiers without a wait cap keep none.
        self._oldest_first: dict[Tier, list[tuple[float, int, Request]]] = {
            t: [] for t in ALL_TIERS if math.isfinite(self._max_wait[t])
        }
        # Models left out of `peek` for the rest of the pass (`set_aside`): wholly, or from
        # a tier on (their queue holds those tiers).
        self._aside: set[str] = set()
        self._holding: set[str] = set()

    def _queue(self, model: str) -> Policy:
        queue = self._queues.get(model)
        if queue is None:
            if len(self._queues) >= MAX_IDLE_QUEUES:  # models gone from the fleet leave none behind
                self._queues = {m: q for m, q in self._queues.items() if len(q)}
            queue = self._queues[model] = create_policy(self._policy_name, self._engine_config)
            queue.keep_undo(True)  # a ticket stepped aside goes back as it was (`readmit`)
        return queue

    def depth(self, tier: Tier | None = None, model: str | None = None) -> int:
        """Requests waiting (at `tier`; for `model`; None: all)."""
        if model is not None:
            queue = self._queues.get(model)
            return 0 if queue is None else queue.num_waiting(tier)
        return sum(q.num_waiting(tier) for q in self._queues.values())

    def is_closed(self, tier: Tier) -> bool:
        """A queue cap of 0: every request of `tier` is refused, as `tierserve serve` refuses it."""
        return self._caps[tier] == 0

    def depth_upto(self, tier: Tier, model: str) -> int:
        """Requests for `model` waiting at `tier` or more urgent: those a new request of
        `tier` for it queues behind."""
        queue = self._queues.get(model)
        return 0 if queue is None else sum(queue.num_waiting(t) for t in ALL_TIERS if t <= tier)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def drained(self, count: int = 1) -> None:
        """Requests left the fleet (finished): the drain rate `retry_after` is computed from."""
        self._meter.record(self._clock.now(), count)

    def retry_after(self, tier: Tier, model: str) -> float:
        """Seconds until the queue ahead of a new request of `tier` for `model` has drained
        at the recent rate. While the rate is not known (under 8 requests finished in its
        window), at most that few finished: the queue ahead is priced at that rate, capped
        at the tier's wait (a steady 1 s had clients of a slow fleet retry every second)."""
        now = self._clock.now()
        ahead = self.depth_upto(tier, model) + 1
        rate = self._meter.rate(now)
        if rate is not None and rate > 0:
            return max(0.001, ahead / rate)
        slowest = max(1, self._meter.count(now)) / self._meter.window_s
        cap = self._max_wait[tier] if math.isfinite(self._max_wait[tier]) else MAX_UNKNOWN_RETRY_S
        return max(DEFAULT_RETRY_S, min(cap, ahead / slowest))

    def offer(
        self,
        tier: Tier,
        tenant: str,
        *,
        model: str = "",
        num_tokens: int = 1,
        tenant_weight: float = 1.0,
        waited_s: float = 0.0,
    ) -> Request | Refusal:
        """Queue a request for `model`; its ticket (a `Request` carrying tier, tenant and
        when it joined) or a refusal. `waited_s`: what a retried request has waited in the
        queue before, its place and its time left kept (queued anew, it went behind requests
        that came after it, and could wait `max_wait_s` once per attempt)."""
        if self.depth(tier, model) >= self._caps[tier]:
            return Refusal(tier, self.depth(tier, model), self.retry_after(tier, model))
        ticket = Request(
            f"gw-{next(self._ids)}",
            [0],
            SamplingParams(max_tokens=max(1, num_tokens)),
            tier=tier,
            tenant=tenant,
            arrival_time=self._clock.now() - waited_s,
            tenant_weight=tenant_weight,
        )
        self._queue(model).add(ticket, ticket.arrival_time)
        self._model_of[ticket.request_id] = model
        oldest_first = self._oldest_first.get(tier)
        if oldest_first is not None:
            heapq.heappush(oldest_first, (ticket.arrival_time, next(self._joins), ticket))
        return ticket

    def _head(self, now: float) -> tuple[str, Request] | None:
        """The most urgent head among the models not set aside: tier, then time queued."""
        best: tuple[str, Request] | None = None
        for model, queue in self._queues.items():
            if model in self._aside or not len(queue):
                continue
            head = queue.peek(now)
            if head is not None and (
                best is None or (head.tier, head.arrival_time) < (best[1].tier, best[1].arrival_time)
            ):
                best = model, head
        return best

    def peek(self, now: float | None = None) -> Request | None:
        """The ticket `release` at the same `now` hands out (aging is applied here)."""
        head = self._head(self._clock.now() if now is None else now)
        return None if head is None else head[1]

    def model_of(self, ticket: Request) -> str:
        return self._model_of[ticket.request_id]

    def set_aside(self, tier: Tier, model: str) -> None:
        """Leave `model`'s requests of `tier` and the less urgent tiers out of `peek` and
        `release` until `end_pass`: no upstream has room for its head of `tier`, and a more
        urgent request for it may still find some (an upstream that orders by priority is
        full for a tier sooner than for those above it); where its policy cannot set tiers
        aside, or `tier` is P0, all of `model`'s. Other models' requests are not held."""
        queue = self._queues[model]
        if tier is Tier.P0 or not queue.holds_tiers:
            self._aside.add(model)
            return
        for t in ALL_TIERS:
            if t >= tier:
                queue.hold_tier(t)
        self._holding.add(model)

    def end_pass(self) -> None:
        """Bring back what `set_aside` left out; what the pass popped is gone for good."""
        for model in self._holding:
            self._queues[model].release_held()
        self._holding.clear()
        self._aside.clear()
        for queue in self._queues.values():
            queue.forget_undo()

    def release(self, now: float | None = None) -> Request | None:
        """Take the next ticket out, in the policy's order, for an upstream that has room."""
        now = self._clock.now() if now is None else now
        head = self._head(now)
        if head is None:
            return None
        ticket = self._queues[head[0]].pop(now)
        del self._model_of[ticket.request_id]
        return ticket

    def step_aside(self, ticket: Request, now: float) -> None:
        """Take `ticket`, the head `peek(now)` showed, out of the queue until `readmit`, in the
        same pass: popped, to be put back as it was (removed and added again, it went behind
        its tenant's younger requests, and expired first)."""
        queue = self._queues[self._model_of[ticket.request_id]]
        if queue.pop(now) is not ticket:
            raise RuntimeError(f"step_aside: {ticket.request_id} is not its queue's head")

    def readmit(self, ticket: Request) -> None:
        """Put back a ticket `step_aside` took out in this pass (the last taken first)."""
        self._queues[self._model_of[ticket.request_id]].put_back(ticket, self._clock.now())

    def cancel(self, ticket: Request) -> None:
        """Take a ticket out whose client went away."""
        model = self._model_of.pop(ticket.request_id)
        self._queues[model].remove(ticket)

    def expire(self) -> list[Request]:
        """Take out and return the tickets that have waited longer than their tier allows,
        P0's first, each tier's oldest first. Costs the tickets that leave (expired or gone
        before), not the queue's length: a tier's tickets run out of time by when they joined."""
        now = self._clock.now()
        late: list[Request] = []
        for tier, oldest_first in self._oldest_first.items():
            max_wait = self._max_wait[tier]
            while oldest_first:
                joined, _, ticket = oldest_first[0]
                if ticket.request_id not in self._model_of:
                    heapq.heappop(oldest_first)  # released or cancelled since
                elif now - joined > max_wait:
                    heapq.heappop(oldest_first)
                    self._queues[self._model_of.pop(ticket.request_id)].remove(ticket)
                    late.append(ticket)
                else:
                    break
        return late

    def waited(self, ticket: Request) -> float:
        """Its time in the queue, a retried request's earlier waits included."""
        return self._clock.now() - ticket.arrival_time
