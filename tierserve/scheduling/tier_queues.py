"""Four FIFO queues, one per tier: the storage most tiered policies share."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from tierserve.request import Request
from tierserve.tiers import ALL_TIERS, Tier


class TierQueues:
    def __init__(self) -> None:
        self.queues: tuple[deque[Request], ...] = tuple(deque() for _ in ALL_TIERS)

    def head(self, tier: Tier) -> Request | None:
        q = self.queues[tier]
        return q[0] if q else None

    def append(self, req: Request) -> None:
        self.queues[req.tier].append(req)

    def appendleft(self, req: Request) -> None:
        self.queues[req.tier].appendleft(req)

    def popleft(self, tier: Tier) -> Request:
        return self.queues[tier].popleft()

    def remove(self, req: Request) -> bool:
        """Remove `req`; returns whether it was the head of its tier's queue."""
        q = self.queues[req.tier]
        was_head = bool(q) and q[0] is req
        q.remove(req)
        return was_head

    def __iter__(self) -> Iterator[Request]:
        for q in self.queues:
            yield from q
