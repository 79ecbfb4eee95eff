"""A waiting queue ordered by (tier, arrival): the priority queue of vLLM and SGLang.

Removal is lazy (a removed request is skipped when it reaches the top), so every
operation is O(log n).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from tierserve.request import Request


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
