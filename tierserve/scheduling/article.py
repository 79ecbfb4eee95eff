"""The source article's production policy, as the article describes it (its
`HybridScheduler`, §3.4, with the reservation and reclaim of §4), with its bugs fixed
as docs/design.md §3 requires and nothing added.

- P0: strict priority, first come first served, with reserved memory (the tier
  partition's floor) and the right to reclaim: when a P0 request does not fit it
  preempts running P3 requests, then P2 (the article's `reclaim_from_low_priority`;
  P1 is never a victim of admission).
- P1-P2: weighted fair queuing (weights 16/8/4/2, cost = prompt + expected output), as
  real start-time fair queuing rather than the article's 8-entry ready heap.
- P3: best effort, admitted only while no P0 or P1 request waits.
- Aging with the article's thresholds, P1 30 s, P2 15 s, P3 5 s: a request that has
  waited past its tier's threshold is promoted one level, and past the next level's
  threshold as well another level. The article checks aging once, at enqueue, when the
  wait is ~0, so it never fires; here it is evaluated on every pass while the request
  waits. A promotion reorders the queue only: memory stays charged to the tier the tenant
  is entitled to, so a P1 aged to P0 never uses P0's reserved floor.
- Preemption per victim by the article's rule: swap when its swap time is under 30 % of
  its prefill time, else recompute.

No step shaping, no SLO rescue, no seat preemption: those are `hybrid`'s additions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from tierserve.config import ConfigError, EngineConfig, PolicyOptions
from tierserve.request import Request
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.scheduling.sfq import TierFairQueues
from tierserve.scheduling.wfq import FairQueuePolicy, expected_cost
from tierserve.tiers import ALL_TIERS, Tier

if TYPE_CHECKING:
    from tierserve.memory.manager import KVCacheManager

FAIR_TIERS = (Tier.P1, Tier.P2)
ARTICLE_SWAP_FACTOR = 0.3  # swap when swapping out takes under 30 % of the prefill time
AGED_TIERS = (Tier.P1, Tier.P2, Tier.P3)


@dataclass(frozen=True)
class ArticleOptions(PolicyOptions):
    p1_aging_s: float = 30.0  # the article's AGING_BOOST_THRESHOLD
    p2_aging_s: float = 15.0
    p3_aging_s: float = 5.0

    def check(self, path: str) -> None:
        for name in ("p1_aging_s", "p2_aging_s", "p3_aging_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{path}.{name}: must be > 0, got {getattr(self, name)}")


class ArticlePolicy(FairQueuePolicy):
    name: ClassVar[str] = "article"
    leaps_decodes: ClassVar[bool] = True  # no step hooks; peek on an empty queue changes nothing
    leaps_while_waiting: ClassVar[bool] = True
    options_type: ClassVar[type[PolicyOptions] | None] = ArticleOptions

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        options = config.options(self.name, ArticleOptions)
        self._weights = [config.tiers[t].wfq_weight for t in ALL_TIERS]
        self._sfq = TierFairQueues(self._weights, expected_cost)
        thresholds = (math.inf, options.p1_aging_s, options.p2_aging_s, options.p3_aging_s)
        # A request of tier t reaches level t - k after waiting _promoted_after[t][k].
        self._promoted_after = [
            [sum(thresholds[t - j] for j in range(k)) for k in range(1, t + 1)] for t in ALL_TIERS
        ]

    def level(self, req: Request, now: float) -> Tier:
        """The tier `req` is served as now: its own, less one per aging threshold passed."""
        waited = now - req.arrival_time
        boosts = sum(1 for after in self._promoted_after[req.tier] if waited > after)
        return Tier(req.tier - boosts)

    def _choose(self, now: float) -> tuple[Tier, Tier, bool] | None:
        """(queue to serve, level it is served at, whether in fair order)."""
        sfq = self._sfq
        if sfq.count(Tier.P0):
            return Tier.P0, Tier.P0, False
        heads = [(t, h) for t in AGED_TIERS if (h := sfq.head_of(t)) is not None]
        levels = {t: self.level(h, now) for t, h in heads}
        promoted = [(h.arrival_time, t) for t, h in heads if levels[t] == Tier.P0]
        if promoted:
            tier = min(promoted)[1]
            return tier, Tier.P0, False
        eligible = [t for t, _ in heads if levels[t] in FAIR_TIERS]
        fair = sfq.best(eligible)
        if fair is not None:
            return fair, levels[fair], True
        # P3 best effort: only while no P0 or P1 request waits (all P1 heads were eligible).
        if sfq.head_of(Tier.P3) is not None and not sfq.count(Tier.P1):
            return Tier.P3, Tier.P3, True
        return None

    def peek(self, now: float) -> Request | None:
        choice = self._choose(now)
        return None if choice is None else self._sfq.head_of(choice[0])

    def _pop(self, now: float) -> Request:
        choice = self._choose(now)
        if choice is None:
            raise EmptyQueueError("pop from an empty queue")
        tier, level, in_order = choice
        return self._sfq.serve(tier, in_order=in_order, weight=self._weights[level])

    def _put_back(self, req: Request, now: float) -> None:
        # Refunded at the weight it was served at: its level then (the same `now` in a pass).
        self._sfq.put_back(req, weight=self._weights[self.level(req, now)])

    def preempts_for_admission(self, req: Request, memory: KVCacheManager, num_blocks: int) -> bool:
        return req.tier == Tier.P0

    def admission_victim_ok(self, req: Request, victim: Request, memory: KVCacheManager) -> bool:
        return victim.tier >= Tier.P2  # P3 first, then P2 (victim_key orders by tier)

    def prefers_swap(self, swap_s: float, prefill_s: float) -> bool:
        return swap_s < ARTICLE_SWAP_FACTOR * prefill_s
