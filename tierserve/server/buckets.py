"""Token buckets behind a small interface, and the in-process backend.

A bucket holds up to `capacity` units and refills at `rate_per_s`. `take` checks several
buckets at once and debits all of them or none (a request must fit the global bucket and
its tenant's). `give` settles a reservation: a positive amount refunds (capped at the
capacity), a negative one charges extra (the level may go below zero: debt that delays
the next request). Backends: `LocalBuckets` (here) and `RedisBuckets` (shared by replicas).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Bucket:
    key: str  # unique name, e.g. "tenant:acme:tokens"
    rate_per_s: float
    capacity: float


@dataclass(frozen=True, slots=True)
class BucketLevel:
    remaining: float  # units left after the take (or now, when refused)
    wait_s: float  # until the requested cost fits; 0 when it does now

    def reset_s(self, bucket: Bucket) -> float:
        """Seconds until the bucket is full again."""
        return max(0.0, bucket.capacity - self.remaining) / bucket.rate_per_s


@dataclass(frozen=True, slots=True)
class TakeResult:
    allowed: bool
    levels: tuple[BucketLevel, ...]  # aligned with the buckets passed to `take`

    @property
    def wait_s(self) -> float:
        return max((lv.wait_s for lv in self.levels), default=0.0)


class BucketBackend(Protocol):
    async def take(self, buckets: Sequence[Bucket], costs: Sequence[float]) -> TakeResult:
        """Debit `costs[i]` from `buckets[i]` for every i if all fit, else debit nothing."""
        ...

    async def give(self, bucket: Bucket, amount: float) -> None:
        """Add `amount` (may be negative) to the bucket, never above its capacity."""
        ...


def refill(level: float, elapsed_s: float, bucket: Bucket) -> float:
    return min(bucket.capacity, level + max(0.0, elapsed_s) * bucket.rate_per_s)


class LocalBuckets:
    """In-process buckets. Safe on one event loop (no awaits inside an operation)."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._state: dict[str, tuple[float, float]] = {}  # key -> (level, time of level)

    def _level(self, bucket: Bucket, now: float) -> float:
        level, at = self._state.get(bucket.key, (bucket.capacity, now))
        return refill(level, now - at, bucket)

    def take_now(self, buckets: Sequence[Bucket], costs: Sequence[float]) -> TakeResult:
        now = self._now()
        levels = [self._level(b, now) for b in buckets]
        allowed = all(level >= cost for level, cost in zip(levels, costs, strict=True))
        out = []
        for bucket, level, cost in zip(buckets, levels, costs, strict=True):
            after = level - cost if allowed else level
            self._state[bucket.key] = (after, now)
            wait = 0.0 if level >= cost else (cost - level) / bucket.rate_per_s
            out.append(BucketLevel(remaining=after, wait_s=wait))
        return TakeResult(allowed=allowed, levels=tuple(out))

    def give_now(self, bucket: Bucket, amount: float) -> None:
        now = self._now()
        level = self._level(bucket, now)
        self._state[bucket.key] = (min(bucket.capacity, level + amount), now)

    async def take(self, buckets: Sequence[Bucket], costs: Sequence[float]) -> TakeResult:
        return self.take_now(buckets, costs)

    async def give(self, bucket: Bucket, amount: float) -> None:
        self.give_now(bucket, amount)
