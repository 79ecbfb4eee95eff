"""What the fleet's autoscaler and report watch: P0's recent SLO attainment at the gateway.

A P0 request counts once, when its first token reaches the client or when it ends without
one; it attains the SLO when its TTFT is within the tier's target.
"""

from __future__ import annotations

from collections import deque

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.fleet.requests import FleetRequest
from tierserve.tiers import Tier


class FleetObserver:
    def __init__(self, clock: Clock, config: EngineConfig | None = None, window_s: float = 60.0) -> None:
        self._clock = clock
        self._target = (config or EngineConfig()).tier(Tier.P0).ttft_target_s
        self._window_s = window_s
        self._p0: deque[tuple[float, bool]] = deque()  # (when, attained)

    def first_token(self, fr: FleetRequest) -> None:
        if fr.tier is Tier.P0 and fr.ttft_s is not None:
            self._p0.append((self._clock.now(), fr.ttft_s <= self._target))

    def ended_without_token(self, fr: FleetRequest) -> None:
        if fr.tier is Tier.P0:
            self._p0.append((self._clock.now(), False))

    def p0_attainment(self) -> float | None:
        horizon = self._clock.now() - self._window_s
        while self._p0 and self._p0[0][0] < horizon:
            self._p0.popleft()
        if not self._p0:
            return None
        return sum(ok for _, ok in self._p0) / len(self._p0)
