"""Plain routers to compare the gateway's own against: no tiers, no saturation, no queue.

Each keeps the `Router`'s bookkeeping (samples, health, in-flight counts) and replaces
only `route`. None of them ever holds a request back: they route to a healthy candidate
whatever its load (a gateway without flow control), and return None only when no
candidate is left.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierserve.clock import Clock
from tierserve.gateway.config import GatewaySettings, UpstreamConfig
from tierserve.gateway.router import RouteDecision, Router, UpstreamState, _affinity
from tierserve.tiers import Tier


class RoundRobinRouter(Router):
    """Each request to the next candidate in name order."""

    def __init__(self, upstreams: Iterable[UpstreamConfig], settings: GatewaySettings, clock: Clock) -> None:
        super().__init__(upstreams, settings, clock)
        self._turn = 0

    def route(self, tier: Tier, prefix: str, model: str, exclude: Iterable[str] = ()) -> RouteDecision | None:
        cands = sorted(self.candidates(model, exclude), key=lambda s: s.name)
        if not cands:
            return None
        chosen = cands[self._turn % len(cands)]
        self._turn += 1
        return RouteDecision(chosen.name, "round_robin", tier)


class LeastLoadedRouter(Router):
    """The candidate with the least scraped load (plus requests sent since its scrape)."""

    def route(self, tier: Tier, prefix: str, model: str, exclude: Iterable[str] = ()) -> RouteDecision | None:
        cands = self.candidates(model, exclude)
        if not cands:
            return None
        best = min(cands, key=lambda s: (self.load(s), s.name))
        return RouteDecision(best.name, "least_loaded", tier)


class PrefixAffinityRouter(Router):
    """The prefix's preferred candidate while its load is within the bound, else the least loaded."""

    def route(self, tier: Tier, prefix: str, model: str, exclude: Iterable[str] = ()) -> RouteDecision | None:
        cands = self.candidates(model, exclude)
        if not cands:
            return None
        least = min(cands, key=lambda s: (self.load(s), s.name))
        preferred = _preferred(prefix, cands)
        if self.load(preferred) <= self._settings.affinity_load_bound * (self.load(least) + 1):
            return RouteDecision(preferred.name, "affinity", tier)
        return RouteDecision(least.name, "least_loaded", tier)


def _preferred(prefix: str, cands: list[UpstreamState]) -> UpstreamState:
    return max(cands, key=lambda s: _affinity(prefix, s.name))
