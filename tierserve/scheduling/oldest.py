"""The oldest waiting request of each tier (or the smallest by another key), kept beside a
fair queue.

A fair queue's head is the request its order serves next, not the one that has waited
longest: inside a tier the tenant-fair order puts a newly returning tenant's fresh request
ahead of another tenant's backlog. A policy that judges a tier's urgency by how long its
requests wait must look at the oldest of them. One heap per tier on arrival time, with
lazy deletion: a request leaves the heap when it reaches the top no longer waiting, or
when the heap, grown past twice the waiting requests, is rebuilt (amortized O(1)), so
the state stays bounded by what waits even while one old request holds the top.

The key is the arrival time unless another is given (hybrid also keeps its waiting P0
prompts shortest first); it must not change while the request waits.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from tierserve.request import Request
from tierserve.tiers import ALL_TIERS, Tier

STALE_FLOOR = 64  # stale entries a heap may hold before it is rebuilt, whatever waits


def _arrival(req: Request) -> float:
    return req.arrival_time


class OldestWaiting:
    def __init__(self, key: Callable[[Request], float] = _arrival) -> None:
        self._key = key
        self._heaps: tuple[list[tuple[float, int, Request]], ...] = tuple([] for _ in ALL_TIERS)
        self._token: dict[Request, int] = {}  # waiting request -> its live heap entry
        self._serial = itertools.count()

    def add(self, req: Request) -> None:
        token = next(self._serial)
        self._token[req] = token
        heap = self._heaps[req.tier]
        heapq.heappush(heap, (self._key(req), token, req))
        if len(heap) > 2 * len(self._token) + STALE_FLOOR:
            heap[:] = [e for e in heap if self._token.get(e[2]) == e[1]]
            heapq.heapify(heap)

    def discard(self, req: Request) -> None:
        """`req` no longer waits (served or removed); its entry goes when it reaches the top."""
        self._token.pop(req, None)

    def heap_size(self, tier: Tier) -> int:
        """Entries held for `tier`, stale ones included (the state a test can bound)."""
        return len(self._heaps[tier])

    def oldest(self, tier: Tier, arrived_after: float = -math.inf) -> Request | None:
        """The oldest (smallest key) waiting request of `tier` whose key is over
        `arrived_after`. Smaller entries are dropped for good, so per tier `arrived_after`
        must never decrease (a request added again later, e.g. put back after a
        preemption, counts again)."""
        heap = self._heaps[tier]
        while heap:
            arrival, token, req = heap[0]
            if self._token.get(req) == token and arrival > arrived_after:
                return req
            heapq.heappop(heap)
        return None

    def first(self, tier: Tier, enough: Callable[[Request], bool]) -> list[Request]:
        """The waiting requests of `tier` in key order, up to the first for which `enough`
        is true (O(k log n) for the k returned; the heap is left as it was, less stale
        entries)."""
        heap = self._heaps[tier]
        taken: list[tuple[float, int, Request]] = []
        while heap:
            entry = heapq.heappop(heap)
            if self._token.get(entry[2]) != entry[1]:
                continue  # no longer waiting
            taken.append(entry)
            if enough(entry[2]):
                break
        for entry in taken:
            heapq.heappush(heap, entry)
        return [entry[2] for entry in taken]
