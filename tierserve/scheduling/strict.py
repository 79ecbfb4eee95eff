"""Strict priority: always the most urgent non-empty tier. Starves lower tiers by design."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling.base import Policy
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.scheduling.tier_queues import TierQueues
from tierserve.tiers import ALL_TIERS

if TYPE_CHECKING:
    from tierserve.memory.manager import KVCacheManager


class StrictPolicy(Policy):
    name: ClassVar[str] = "strict"
    leaps_decodes: ClassVar[bool] = True  # no step hooks; peek on an empty queue changes nothing

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._queues = TierQueues()

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

    def _push(self, req: Request, now: float) -> None:
        self._queues.append(req)

    def _push_front(self, req: Request, now: float) -> None:
        self._queues.appendleft(req)

    def _remove(self, req: Request) -> None:
        self._queues.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queues)

    def preempts_for_admission(self, req: Request, memory: KVCacheManager, num_blocks: int) -> bool:
        return True
