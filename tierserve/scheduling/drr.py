"""Deficit round robin over the tiers (Shreedhar & Varghese, SIGCOMM 1995).

`drr` counts requests, as the source article does (quantum = weight 8/4/2/1 requests a
round). `drr-tokens` counts cost in tokens (prompt + expected output), so a long
request uses up its tier's turn as it should.
"""

from __future__ import annotations

import math
from collections import deque
from typing import ClassVar

from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.scheduling.fair_queue import SERVES_KEPT
from tierserve.scheduling.tier_queues import TierQueuesPolicy
from tierserve.tiers import ALL_TIERS, Tier


class DrrPolicy(TierQueuesPolicy):
    name: ClassVar[str] = "drr"
    leaps_decodes: ClassVar[bool] = True  # no step hooks; peek on an empty queue changes nothing
    leaps_while_waiting: ClassVar[bool] = True
    counts_tokens: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        unit = config.scheduler.drr_quantum_tokens if self.counts_tokens else 1
        self._quantum = [config.tiers[t].drr_weight * unit for t in ALL_TIERS]
        self._deficit = [0.0] * len(ALL_TIERS)
        self._current = Tier.P3  # the first turn goes to P0
        # The latest pops, each with the round before it (deficits, turn), for `put_back`.
        self._served: deque[tuple[Request, list[float], Tier]] = deque(maxlen=SERVES_KEPT)

    def _cost(self, req: Request) -> float:
        return float(req.expected_cost_tokens) if self.counts_tokens else 1.0

    def _select(self) -> Tier | None:
        """Move the round-robin pointer to a tier whose head fits its deficit.

        Arriving at a backlogged tier starts its turn and adds one quantum; the turn
        lasts while the head fits. A head costlier than a quantum waits several rounds.
        """
        if not any(self._queues.queues):
            return None
        self._skip_idle_rounds()
        while True:
            tier = self._current
            head = self._queues.head(tier)
            if head is None:
                self._deficit[tier] = 0.0
            elif self._cost(head) <= self._deficit[tier]:
                return tier
            self._current = nxt = Tier((tier + 1) % len(ALL_TIERS))
            if self._queues.queues[nxt]:
                self._deficit[nxt] += self._quantum[nxt]

    def _skip_idle_rounds(self) -> None:
        """Give every backlogged tier at once the quanta of the whole rounds in which no head
        would fit, then let the loop finish the last round as before (the same choice).
        Round by round, a head of 1,000 tokens under `drr_weight` 0.001 and
        `drr_quantum_tokens` 1 took a million rounds: the run never ended."""
        backlogged = [t for t in ALL_TIERS if self._queues.queues[t]]
        rounds = min(
            (self._cost(head) - self._deficit[t]) / self._quantum[t]
            for t in backlogged
            if (head := self._queues.head(t)) is not None
        )
        if 1 < rounds < math.inf:
            skipped = math.ceil(rounds) - 1  # each tier still needs a quantum more after these
            for t in backlogged:
                self._deficit[t] += skipped * self._quantum[t]

    def peek(self, now: float) -> Request | None:
        tier = self._select()
        return None if tier is None else self._queues.head(tier)

    def _pop(self, now: float) -> Request:
        before = (list(self._deficit), self._current) if self.keeps_undo else None
        tier = self._select()
        if tier is None:
            raise EmptyQueueError("pop from an empty queue")
        req = self._queues.popleft(tier)
        if before is not None:
            self._served.append((req, *before))
        self._deficit[tier] -= self._cost(req)
        if not self._queues.queues[tier]:
            self._deficit[tier] = 0.0
        return req

    def _put_back(self, req: Request, now: float) -> None:
        super()._put_back(req, now)
        served = self._served
        if served and served[-1][0] is req:  # the latest pop: the round as it was before it
            _, deficit, current = served.pop()
            self._deficit, self._current = deficit, current
        else:  # its cost back to its tier (all of it if the tier emptied: enough for it)
            self._deficit[req.tier] += self._cost(req)

    def forget_undo(self) -> None:
        super().forget_undo()
        self._served.clear()


class TokenDrrPolicy(DrrPolicy):
    name: ClassVar[str] = "drr-tokens"
    counts_tokens: ClassVar[bool] = True
