"""Flow control: while every upstream is saturated, requests wait here in tier queues.

The queues are a tierserve scheduling policy (hybrid by default, with its aging and
SLO rescue), so the gateway releases requests in the order the engine would admit them.
Each tier has a cap on its queue length and on the time a request may wait. A request
refused because its tier's queue is full gets a `retry_after` of the queue ahead of it
divided by the measured drain rate (requests the fleet finished per second recently).

Plain state on an injected clock, no I/O: the gateway's dispatcher calls `offer`,
`release` and `expire`; a fleet simulation can call the same in virtual time.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.request import Request, SamplingParams
from tierserve.scheduling import Policy, create_policy
from tierserve.server.admission import ThroughputMeter
from tierserve.tiers import ALL_TIERS, Tier

DEFAULT_RETRY_S = 1.0  # while the drain rate is not known yet


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
        self._policy: Policy = create_policy(policy, engine_config)
        self._caps = {t: queue_caps[t] for t in ALL_TIERS}
        self._max_wait = {t: max_wait_s[t] for t in ALL_TIERS}
        self._clock = clock
        self._meter = drain_meter or ThroughputMeter()
        self._ids = itertools.count()
        # Each tier's tickets in arrival order, for `expire`: the oldest are the first to
        # run out of time. Tickets that left the queue are dropped when they reach the
        # front (`_queued` says which are still in it). Tiers without a wait cap keep none.
        self._oldest_first: dict[Tier, deque[Request]] = {
            t: deque() for t in ALL_TIERS if math.isfinite(self._max_wait[t])
        }
        self._queued: set[str] = set()

    def depth(self, tier: Tier | None = None) -> int:
        return self._policy.num_waiting(tier)

    def is_closed(self, tier: Tier) -> bool:
        """A queue cap of 0: every request of `tier` is refused, as `tierserve serve` refuses it."""
        return self._caps[tier] == 0

    def depth_upto(self, tier: Tier) -> int:
        """Requests waiting at `tier` or more urgent: those a new request of `tier` queues behind."""
        return sum(self._policy.num_waiting(t) for t in ALL_TIERS if t <= tier)

    def __len__(self) -> int:
        return len(self._policy)

    def drained(self, count: int = 1) -> None:
        """Requests left the fleet (finished): the drain rate `retry_after` is computed from."""
        self._meter.record(self._clock.now(), count)

    def retry_after(self, tier: Tier) -> float:
        """Seconds until the queue ahead of a new request of `tier` has drained at the recent rate."""
        rate = self._meter.rate(self._clock.now())
        if rate is None or rate <= 0:
            return DEFAULT_RETRY_S
        return max(0.001, (self.depth_upto(tier) + 1) / rate)

    def offer(
        self, tier: Tier, tenant: str, *, num_tokens: int = 1, tenant_weight: float = 1.0
    ) -> Request | Refusal:
        """Queue a request; its ticket (a `Request` carrying tier, tenant and arrival) or a refusal."""
        if self._policy.num_waiting(tier) >= self._caps[tier]:
            return Refusal(tier, self._policy.num_waiting(tier), self.retry_after(tier))
        ticket = Request(
            f"gw-{next(self._ids)}",
            [0],
            SamplingParams(max_tokens=max(1, num_tokens)),
            tier=tier,
            tenant=tenant,
            arrival_time=self._clock.now(),
            tenant_weight=tenant_weight,
        )
        self._policy.add(ticket, ticket.arrival_time)
        self._queued.add(ticket.request_id)
        oldest_first = self._oldest_first.get(tier)
        if oldest_first is not None:
            oldest_first.append(ticket)
        return ticket

    def peek(self, now: float | None = None) -> Request | None:
        """The ticket `release` at the same `now` hands out (aging is applied here)."""
        return self._policy.peek(self._clock.now() if now is None else now)

    def set_aside(self, tier: Tier) -> bool:
        """Leave `tier` and the less urgent tiers out of `peek` and `release` until
        `end_pass`: no upstream has room for `tier`'s head, and a more urgent request may
        still find some (an upstream that orders by priority is full for a tier sooner
        than for those above it). False where the policy cannot set tiers aside."""
        if not self._policy.holds_tiers:
            return False
        for t in ALL_TIERS:
            if t >= tier:
                self._policy.hold_tier(t)
        return True

    def end_pass(self) -> None:
        """Bring back the tiers `set_aside` left out."""
        if self._policy.holds_tiers:
            self._policy.release_held()

    def release(self, now: float | None = None) -> Request | None:
        """Take the next ticket out, in the policy's order, for an upstream that has room."""
        if not len(self._policy):
            return None
        ticket = self._policy.pop(self._clock.now() if now is None else now)
        self._queued.discard(ticket.request_id)
        return ticket

    def cancel(self, ticket: Request) -> None:
        """Take a ticket out whose client went away."""
        self._policy.remove(ticket)
        self._queued.discard(ticket.request_id)

    def expire(self) -> list[Request]:
        """Take out and return the tickets that have waited longer than their tier allows,
        P0's first, each tier's oldest first. Costs the tickets that leave (expired or gone
        before), not the queue's length: a tier's tickets run out of time in arrival order."""
        now = self._clock.now()
        late: list[Request] = []
        for tier, oldest_first in self._oldest_first.items():
            max_wait = self._max_wait[tier]
            while oldest_first:
                ticket = oldest_first[0]
                if ticket.request_id not in self._queued:
                    oldest_first.popleft()  # released or cancelled since
                elif now - ticket.arrival_time > max_wait:
                    oldest_first.popleft()
                    self._policy.remove(ticket)
                    self._queued.discard(ticket.request_id)
                    late.append(ticket)
                else:
                    break
        return late

    def waited(self, ticket: Request) -> float:
        return self._clock.now() - ticket.arrival_time
