"""The policy vLLM users get today with `--scheduling-policy priority` (the baseline).

A heap on (priority, arrival); when a running request needs a block and none is free,
the running request with the largest (priority, arrival) is preempted by recompute —
possibly the requester itself. No aging, no memory reservations, no swap, and a waiting
request never preempts a running one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import ClassVar

from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling.base import Policy


class VllmPriorityPolicy(Policy):
    name: ClassVar[str] = "vllm-priority"
    tiered_memory: ClassVar[bool] = False
    allow_swap: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._removed: set[int] = set()  # ids (id()) of requests removed while in the heap

    def _clean_top(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self, now: float) -> Request | None:
        self._clean_top()
        return self._heap[0][3] if self._heap else None

    def _pop(self, now: float) -> Request:
        self._clean_top()
        return heapq.heappop(self._heap)[3]

    def _push(self, req: Request, now: float) -> None:
        heapq.heappush(self._heap, (int(req.tier), req.arrival_time, next(self._counter), req))

    def _push_front(self, req: Request, now: float) -> None:
        self._push(req, now)  # the heap order already puts it where it belongs

    def _remove(self, req: Request) -> None:
        self._removed.add(id(req))

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap if id(entry[3]) not in self._removed)

    def victim_key(self, victim: Request, borrowed: Sequence[int]) -> tuple[float, ...]:
        return (-victim.tier, -victim.arrival_time)
