"""One queue per tier, fair between tenants inside a tier: the storage every tiered
policy shares.

Inside a tier, tenants share service in proportion to their fair-share weight
(`Request.tenant_weight`): start-time fair queuing over the tenants (`fair_queue.py`)
with cost = prompt + expected output tokens; each tenant's own requests stay in arrival
order. With one tenant a tier is a plain FIFO. The state held is bounded by the tenants
that are active, whatever the pattern of tenant ids.
"""

from __future__ import annotations

from collections.abc import Iterator

from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling.base import Policy
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.scheduling.fair_queue import FifoFlow, StartTimeFairQueue
from tierserve.tiers import ALL_TIERS, Tier


def _tenant(req: Request) -> str:
    return req.tenant


def _tenant_weight(tenant: str, req: Request) -> float:
    return req.tenant_weight


def _cost(req: Request) -> float:
    return float(req.expected_cost_tokens)


class TenantFairQueue(StartTimeFairQueue[str]):
    """The requests of one tier, fair between tenants; itself a flow of the tier-level queue."""

    def __init__(self) -> None:
        super().__init__(_tenant, FifoFlow, _tenant_weight, _cost)

    def head(self) -> Request | None:
        key = self.next_flow()
        return None if key is None else self.head_of(key)


class TierQueues:
    def __init__(self) -> None:
        self.queues: tuple[TenantFairQueue, ...] = tuple(TenantFairQueue() for _ in ALL_TIERS)

    def head(self, tier: Tier) -> Request | None:
        return self.queues[tier].head()

    def append(self, req: Request) -> None:
        self.queues[req.tier].append(req)

    def appendleft(self, req: Request) -> None:
        self.queues[req.tier].appendleft(req)

    def popleft(self, tier: Tier) -> Request:
        if not self.queues[tier]:
            raise EmptyQueueError(f"pop from the empty {tier.name} queue")
        return self.queues[tier].popleft()

    def remove(self, req: Request) -> None:
        self.queues[req.tier].remove(req)

    def put_back(self, req: Request) -> None:
        self.queues[req.tier].put_back(req)

    def __iter__(self) -> Iterator[Request]:
        for q in self.queues:
            yield from q


class TierQueuesPolicy(Policy):
    """A policy that keeps its waiting requests in `TierQueues` (one fair queue per tier)
    and decides only which tier's head goes next."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._queues = TierQueues()

    def _push(self, req: Request, now: float) -> None:
        self._queues.append(req)

    def _push_front(self, req: Request, now: float) -> None:
        self._queues.appendleft(req)

    def _put_back(self, req: Request, now: float) -> None:
        self._queues.put_back(req)

    def keep_undo(self, on: bool = True) -> None:
        super().keep_undo(on)
        for queue in self._queues.queues:
            queue.keep_undo(on)

    def forget_undo(self) -> None:
        for queue in self._queues.queues:
            queue.forget_undo()

    def _remove(self, req: Request) -> None:
        self._queues.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queues)
