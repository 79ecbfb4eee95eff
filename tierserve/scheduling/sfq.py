"""Start-time fair queuing over the tiers: each tier is a flow with its weight, and each
tier's queue is itself fair between tenants. One implementation (`fair_queue.py`) serves
both levels."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from tierserve.request import Request
from tierserve.scheduling.fair_queue import StartTimeFairQueue
from tierserve.scheduling.tier_queues import TenantFairQueue
from tierserve.tiers import Tier


def _tier(req: Request) -> Tier:
    return req.tier


class TierFairQueues(StartTimeFairQueue[Tier]):
    def __init__(self, weights: Sequence[float], cost: Callable[[Request], float]) -> None:
        self.weights = list(weights)
        super().__init__(_tier, TenantFairQueue, self._tier_weight, cost)

    def _tier_weight(self, tier: Tier, req: Request) -> float:
        return self.weights[tier]

    def tenants(self, tier: Tier) -> TenantFairQueue:
        """The queue of a tier with waiting requests, fair between its tenants."""
        return cast("TenantFairQueue", self.flows[tier])

    def count(self, tier: Tier) -> int:
        flow = self.flows.get(tier)
        return 0 if flow is None else len(flow)
