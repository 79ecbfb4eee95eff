"""Injected clocks: the same engine runs on virtual time (simulation) and wall time."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary origin."""
        ...

    def elapse(self, seconds: float) -> None:
        """Account for work that took `seconds`; a wall clock has already moved."""
        ...


class WallClock:
    """`time.monotonic()` from `origin` (default: now). Processes given the same origin tell the
    same time: the monotonic clock is system-wide."""

    def __init__(self, origin: float | None = None) -> None:
        self._origin = time.monotonic() if origin is None else origin

    @property
    def origin(self) -> float:
        return self._origin

    def now(self) -> float:
        return time.monotonic() - self._origin

    def elapse(self, seconds: float) -> None:
        return None


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def elapse(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"cannot elapse negative time ({seconds})")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        """Jump forward to `t` (used by drivers while the engine is idle)."""
        if t > self._now:
            self._now = t
