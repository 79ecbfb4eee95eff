"""Start-time fair queuing over the tier queues (Goyal, Vin & Cheng, SIGCOMM 1996).

Each tier is a flow with a weight. The head of a tier's queue gets the start tag
S = max(V, F_last[tier]); serving it sets F_last[tier] = S + cost / weight and advances
the virtual time V to S. The head with the smallest start tag is served next, so under
backlog each tier receives service (in cost units) in proportion to its weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tierserve.request import Request
from tierserve.scheduling.tier_queues import TierQueues
from tierserve.tiers import ALL_TIERS, Tier


class StartTimeFairQueues(TierQueues):
    def __init__(self, weights: list[float], cost: Callable[[Request], float]) -> None:
        super().__init__()
        self.weights = weights
        self.cost = cost
        self.virtual_time = 0.0
        self.last_finish = [0.0] * len(ALL_TIERS)
        self._head_start: list[float | None] = [None] * len(ALL_TIERS)

    def start_tag(self, tier: Tier) -> float:
        tag = self._head_start[tier]
        if tag is None:
            tag = max(self.virtual_time, self.last_finish[tier])
            self._head_start[tier] = tag
        return tag

    def best(self, tiers: Iterable[Tier]) -> Tier | None:
        """The eligible non-empty tier whose head has the smallest start tag."""
        best: Tier | None = None
        best_tag = 0.0
        for tier in tiers:
            if not self.queues[tier]:
                continue
            tag = self.start_tag(tier)
            if best is None or tag < best_tag:
                best, best_tag = tier, tag
        return best

    def serve(self, tier: Tier, *, in_order: bool = True, weight: float | None = None) -> Request:
        """Pop the head of `tier`. Out-of-order pops (aging) are charged but keep V.
        `weight` charges the request at another weight than its tier's (a promotion)."""
        start = self.start_tag(tier)
        req = self.popleft(tier)
        self.last_finish[tier] = start + self.cost(req) / (weight or self.weights[tier])
        if in_order:
            self.virtual_time = max(self.virtual_time, start)
        self._head_start[tier] = None
        return req

    def appendleft(self, req: Request) -> None:
        super().appendleft(req)
        self._head_start[req.tier] = None

    def remove(self, req: Request) -> bool:
        was_head = super().remove(req)
        if was_head:
            self._head_start[req.tier] = None
        return was_head
