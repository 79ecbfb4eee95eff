"""What the fleet's autoscaler watches: P0's recent SLO attainment at the gateway.

A P0 request counts once, when its first token reaches the client or when it ends without
one; it attains the SLO when its TTFT is within the tier's target. Given `alone_s` (a
request's TTFT alone on an idle replica, by its prompt and cached history: the bench's
`IdleTtft`), a P0 request that would miss the target even alone does not count: no
number of replicas brings it within the target, and counted, a trace with such prompts
(Azure's conversation trace has ~8 % of them) holds P0's attainment under the tier
policy's floor at any fleet size, which then scales out to its maximum whatever the load.
A gateway knows the prompt's length and the model's prefill speed, so a real autoscaler
can draw the same line.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.fleet.requests import FleetRequest
from tierserve.tiers import Tier

AloneTtft = Callable[[int, int], float]  # (prompt tokens, cached history tokens) -> TTFT alone, s
MAX_PROMPT_TOKENS = 1 << 24  # the search's bound, far past any model's context


class FleetObserver:
    def __init__(
        self,
        clock: Clock,
        config: EngineConfig | None = None,
        window_s: float = 60.0,
        alone_s: AloneTtft | None = None,
    ) -> None:
        self._clock = clock
        self._target = (config or EngineConfig()).tier(Tier.P0).ttft_target_s
        self._window_s = window_s
        self._alone_s = alone_s
        self._longest: dict[int, int] = {}  # cached history tokens -> longest prompt within target
        self._p0: deque[tuple[float, bool]] = deque()  # (when, attained)

    def first_token(self, fr: FleetRequest) -> None:
        if fr.tier is Tier.P0 and fr.ttft_s is not None and self._helped_by_capacity(fr):
            self._p0.append((self._clock.now(), fr.ttft_s <= self._target))

    def ended_without_token(self, fr: FleetRequest) -> None:
        if fr.tier is Tier.P0 and self._helped_by_capacity(fr):
            self._p0.append((self._clock.now(), False))

    def _helped_by_capacity(self, fr: FleetRequest) -> bool:
        """Whether the request alone would meet P0's target (True without `alone_s`)."""
        if self._alone_s is None or fr.spec is None:
            return True
        history = fr.spec.num_history_tokens
        longest = self._longest.get(history)
        if longest is None:
            longest = self._longest[history] = self._longest_within_target(self._alone_s, history)
        return fr.spec.num_prompt_tokens <= longest

    def _longest_within_target(self, alone_s: AloneTtft, history: int) -> int:
        """The longest prompt, after `history` cached tokens, whose TTFT alone is within
        P0's target (`history` if none is). A TTFT alone grows with the prompt, so this is a
        search of a few dozen idle runs per history, not one run per prompt length: a
        trace's P0 prompts come in thousands of lengths."""

        def within(num_prompt_tokens: int) -> bool:
            try:
                return alone_s(num_prompt_tokens, history) <= self._target
            except ValueError:  # it does not fit on an idle replica at all
                return False

        if not within(history + 1):
            return history
        lo, hi = history + 1, 2 * (history + 1)  # within, and to be tried
        while within(hi):  # ends: past the context, a prompt does not fit
            if hi > MAX_PROMPT_TOKENS:
                return hi
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if within(mid) else (lo, mid)
        return lo

    def p0_attainment(self, since: float = -math.inf) -> tuple[float | None, int]:
        """P0's attainment over the window, counting only the requests counted at or after
        `since` (None if there are none), and how many it counts."""
        horizon = self._clock.now() - self._window_s
        while self._p0 and self._p0[0][0] < horizon:
            self._p0.popleft()
        counted = [ok for t, ok in self._p0 if t >= since]
        if not counted:
            return None, 0
        return sum(counted) / len(counted), len(counted)
