"""Admission: per-tier queue caps and early rejection of requests that would miss their deadline.

The wait of a new request at tier t is estimated as the number of requests queued ahead
of it (waiting at tier t or a more urgent one) divided by the rate at which the engine
has recently been starting requests (first tokens per second). When that estimate
already exceeds the tier's TTFT target, waiting is pointless: reject now with 503 and a
Retry-After, rather than time out later. With few starts in the window (under 8 in 10 s)
the rate is taken as that few over the whole window (as the gateway prices its queue): an
engine that starts under 0.8 requests a second (long outputs, a large model on few GPUs)
had no estimate at all, and admitted P0 requests to 42 s of waiting. With none in the
window (an engine idle until now) there is no estimate, and nothing is refused for it.

The start rate is the engine's capacity only while the engine is full; on a lightly
loaded one it is the recent demand, and a burst would look like minutes of queue. So the
deadline applies only while the engine's last scheduling pass left a request of tier t or
a more urgent one waiting (it found no room for it): until then everything queued is
admitted at the next step boundary.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from tierserve.config import TierConfig
from tierserve.tiers import ALL_TIERS, Tier


class ThroughputMeter:
    """Events per second over a sliding window. `record` may be called from any thread."""

    def __init__(self, window_s: float = 10.0, min_events: int = 8) -> None:
        self._window_s = window_s
        self._min_events = min_events
        self._times: deque[float] = deque()
        self._lock = threading.Lock()

    def record(self, t: float, count: int = 1) -> None:
        with self._lock:
            self._times.extend([t] * count)
            self._trim(t)

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self._window_s:
            self._times.popleft()

    @property
    def window_s(self) -> float:
        return self._window_s

    def count(self, now: float) -> int:
        """Events in the window ending at `now`."""
        with self._lock:
            self._trim(now)
            return len(self._times)

    def rate(self, now: float) -> float | None:
        """Events per second, or None when the window holds too few events to tell."""
        with self._lock:
            self._trim(now)
            n = len(self._times)
            if n < self._min_events:
                return None
            span = max(now - self._times[0], 1e-3)
        return n / span

    def cautious_rate(self, now: float) -> float | None:
        """`rate`, or where the window holds too few events to tell, that few over the whole
        window: the most it can be said to have shown. None for an empty window (an engine
        idle until now: a burst on it would read as minutes of queue)."""
        rate = self.rate(now)
        if rate is not None:
            return rate
        count = self.count(now)
        return count / self._window_s if count else None


@dataclass(frozen=True, slots=True)
class AdmissionVerdict:
    admitted: bool
    reason: str = ""  # when refused: "queue_full" or "deadline"
    queue_depth: int = 0  # requests queued at this tier
    estimated_wait_s: float | None = None
    retry_after_s: float = 0.0


class AdmissionController:
    def __init__(
        self, tiers: Mapping[Tier, TierConfig], queue_caps: Mapping[Tier, int], meter: ThroughputMeter
    ) -> None:
        self._targets = {t: tiers[t].ttft_target_s for t in ALL_TIERS}
        self._caps = dict(queue_caps)
        self._meter = meter

    def check(
        self,
        tier: Tier,
        queued: Mapping[Tier, int],
        now: float,
        left_waiting: Mapping[Tier, int] | None = None,
    ) -> AdmissionVerdict:
        """`queued[t]`: requests of tier t not yet started (engine waiting queue + inbox);
        `left_waiting[t]`: those of tier t the engine's last pass found no room for (None:
        not known, taken as some)."""
        depth = queued.get(tier, 0)
        ahead = sum(queued.get(t, 0) for t in ALL_TIERS if t <= tier)
        rate = self._meter.cautious_rate(now)
        wait = None if rate is None else ahead / rate
        if depth >= self._caps[tier]:
            known = self._meter.rate(now)  # a cautious guess would say 10 s where 1 s may do
            retry = 1.0 if known is None else max(1.0, (depth - self._caps[tier] + 1) / known)
            return AdmissionVerdict(False, "queue_full", depth, wait, retry)
        target = self._targets[tier]
        full = left_waiting is None or any(left_waiting.get(t, 0) for t in ALL_TIERS if t <= tier)
        if full and wait is not None and math.isfinite(target) and wait > target:
            return AdmissionVerdict(False, "deadline", depth, wait, max(1.0, wait - target))
        return AdmissionVerdict(True, "", depth, wait, 0.0)
