"""Strict priority: always the most urgent non-empty tier. Starves lower tiers by design."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from tierserve.request import Request
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.scheduling.tier_queues import TierQueuesPolicy
from tierserve.tiers import ALL_TIERS

if TYPE_CHECKING:
    from tierserve.memory.manager import KVCacheManager


class StrictPolicy(TierQueuesPolicy):
    name: ClassVar[str] = "strict"
    leaps_decodes: ClassVar[bool] = True  # no step hooks; peek on an empty queue changes nothing
    leaps_while_waiting: ClassVar[bool] = True

    def peek(self, now: float) -> Request | None:
        for tier in ALL_TIERS:
            head = self._queues.head(tier)
            if head is not None:
                return head
        return None

    def _pop(self, now: float) -> Request:
        req = self.peek(now)
        if req is None:
            raise EmptyQueueError("pop from an empty queue")
        return self._queues.popleft(req.tier)

    def preempts_for_admission(self, req: Request, memory: KVCacheManager, num_blocks: int) -> bool:
        return True
