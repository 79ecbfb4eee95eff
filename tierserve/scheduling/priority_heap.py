"""A waiting queue ordered by (tier, arrival): the priority queue of vLLM and SGLang.

Removal is lazy (a removed request is skipped when it reaches the top), so every
operation is O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling.base import Policy


class PriorityHeap:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()
        self._removed: set[int] = set()  # id() of requests removed while in the heap

    def _clean_top(self) -> None:
        while self._heap and id(self._heap[0][3]) in self._removed:
            self._removed.discard(id(heapq.heappop(self._heap)[3]))

    def peek(self) -> Request | None:
        self._clean_top()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Request:
        self._clean_top()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[3]

    def push(self, req: Request) -> None:
        heapq.heappush(self._heap, (int(req.tier), req.arrival_time, next(self._counter), req))

    def remove(self, req: Request) -> None:
        self._removed.add(id(req))

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._heap if id(entry[3]) not in self._removed)


class HeapPolicy(Policy):
    """A policy whose waiting queue is one `PriorityHeap` (vLLM's and SGLang's): requeued
    requests need no special place, the (tier, arrival) order already puts them back."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._heap = PriorityHeap()

    def peek(self, now: float) -> Request | None:
        return self._heap.peek()

    def _pop(self, now: float) -> Request:
        return self._heap.pop()

    def _push(self, req: Request, now: float) -> None:
        self._heap.push(req)

    def _push_front(self, req: Request, now: float) -> None:
        self._heap.push(req)

    def _remove(self, req: Request) -> None:
        self._heap.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._heap)
