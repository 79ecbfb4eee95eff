"""The fleet's event queue: one virtual clock, events taken in time order.

At equal times, arrivals come first (so a request arriving exactly at a step boundary
joins that step, as in `bench`'s driver), then replica start-ups and faults, then step
boundaries, then the gateway's scrapes and the autoscaler's ticks. Ties keep the order
events were pushed in.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from dataclasses import dataclass, field


class EventKind(enum.IntEnum):
    ARRIVAL = 0
    READY = 1
    KILL = 2
    BOUNDARY = 3
    SCRAPE = 4
    AUTOSCALE = 5


@dataclass(order=True, frozen=True, slots=True)
class Event:
    time: float
    kind: EventKind
    seq: int
    target: str = field(compare=False, default="")  # replica name, where it has one
    token: int = field(compare=False, default=0)  # a boundary's generation (stale ones are skipped)


class EventQueue:
    def __init__(self) -> None:
        self._heap: list[Event] = []
        self._seq = itertools.count()

    def push(self, time: float, kind: EventKind, target: str = "", token: int = 0) -> None:
        heapq.heappush(self._heap, Event(time, kind, next(self._seq), target, token))

    def pop(self) -> Event:
        return heapq.heappop(self._heap)

    def next_time(self, skip: EventKind) -> float:
        """When the next event of any kind but `skip` happens (inf: none is queued)."""
        return min((ev.time for ev in self._heap if ev.kind is not skip), default=math.inf)

    def __len__(self) -> int:
        return len(self._heap)
