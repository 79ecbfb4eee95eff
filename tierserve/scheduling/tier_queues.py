"""One queue per tier, fair between tenants inside a tier: the storage every tiered
policy shares.

Inside a tier, tenants share service in proportion to their fair-share weight
(`Request.tenant_weight`), by start-time fair queuing over the tenants with cost =
prompt + expected output tokens; each tenant's own requests stay in arrival order. With
one tenant a tier is a plain FIFO.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tierserve.request import Request
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.tiers import ALL_TIERS, Tier

# `_last_finish` is pruned of tags that can no longer matter once it holds more than this
# many tenants (and four times those queued): tenants come and go (an open server labels
# a tenant per `x-tenant-id`), and the dict must not grow with every name ever seen.
PRUNE_AT = 64


class TenantFairQueue:
    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}
        self._last_finish: dict[str, float] = {}
        self._virtual_time = 0.0
        self._len = 0
        self._head: Request | None = None  # cached; None when stale or empty

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for q in self._queues.values():
            yield from q

    def _start(self, tenant: str) -> float:
        return max(self._virtual_time, self._last_finish.get(tenant, 0.0))

    def head(self) -> Request | None:
        if self._head is None and self._len:
            if len(self._queues) == 1:
                self._head = next(iter(self._queues.values()))[0]
            else:
                self._head = min(
                    (q[0] for q in self._queues.values()),
                    key=lambda r: (self._start(r.tenant), r.arrival_time),
                )
        return self._head

    def append(self, req: Request) -> None:
        q = self._queues.setdefault(req.tenant, deque())
        q.append(req)
        self._len += 1
        if len(q) == 1:
            self._head = None

    def appendleft(self, req: Request) -> None:
        self._queues.setdefault(req.tenant, deque()).appendleft(req)
        self._len += 1
        self._head = None

    def popleft(self) -> Request:
        req = self.head()
        if req is None:
            raise EmptyQueueError("pop from an empty queue")
        start = self._start(req.tenant)
        self._last_finish[req.tenant] = start + req.expected_cost_tokens / req.tenant_weight
        self._virtual_time = start
        self._take(req)
        if len(self._last_finish) > max(PRUNE_AT, 4 * len(self._queues)):
            self._prune()
        return req

    def _prune(self) -> None:
        """Forget finish tags at or behind the virtual time: `_start` gives the virtual time
        for them and for an absent tenant alike, and the virtual time never goes back."""
        now = self._virtual_time
        self._last_finish = {t: f for t, f in self._last_finish.items() if f > now}

    def remove(self, req: Request) -> None:
        self._take(req)

    def _take(self, req: Request) -> None:
        q = self._queues[req.tenant]
        if q[0] is req:
            q.popleft()
        else:
            q.remove(req)
        if not q:
            del self._queues[req.tenant]
        self._len -= 1
        if req is self._head:  # any other head stays the smallest start tag
            self._head = None


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
        return self.queues[tier].popleft()

    def remove(self, req: Request) -> bool:
        """Remove `req`; returns whether it was the head of its tier's queue."""
        q = self.queues[req.tier]
        was_head = q.head() is req
        q.remove(req)
        return was_head

    def __iter__(self) -> Iterator[Request]:
        for q in self.queues:
            yield from q
