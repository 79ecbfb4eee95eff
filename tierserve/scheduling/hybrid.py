"""The production policy: P0 strict with reserved memory and the right to reclaim;
P1–P2 by weighted fair queuing, with an SLO rescue; P3 best effort; aging so nothing
waits forever.

Order of service: P0; then aged heads; then any P1–P2 head that has waited over half
its TTFT target, earliest deadline (arrival + target) first — under overload this keeps
P1's 5 s target ahead of P2's 60 s one instead of sharing the delay by weight; then the
fair order (P3 joins it only while no P1 request waits).

Aging is evaluated on every scheduling pass (not at enqueue, when the wait is ~0): the
head of a tier that has waited longer than the tier's `aging_s` is served ahead of the
fair order, oldest first, right after P0 — unless a more urgent tier's head has waited
longer still, so aging never lets a request overtake an older, more urgent one (under
overload every head ages, and the lower tiers' shorter thresholds would otherwise invert
the priorities). It changes the order only — memory is always accounted to the tier the
tenant is entitled to, so an aged P1 never holds P0's floor.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling.base import Policy
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.scheduling.sfq import TierFairQueues
from tierserve.scheduling.wfq import expected_cost
from tierserve.tiers import ALL_TIERS, Tier

if TYPE_CHECKING:
    from tierserve.memory.manager import KVCacheManager

RESCUE_FRACTION = 0.5  # of the TTFT target a P1-P2 head may wait before it is rescued
FAIR_TIERS = (Tier.P1, Tier.P2)
FAIR_TIERS_WITH_P3 = (Tier.P1, Tier.P2, Tier.P3)


class HybridPolicy(Policy):
    name: ClassVar[str] = "hybrid"
    shapes_steps: ClassVar[bool] = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        weights = [config.tiers[t].wfq_weight for t in ALL_TIERS]
        self._sfq = TierFairQueues(weights, expected_cost)
        self._aging_s = [config.tiers[t].aging_s for t in ALL_TIERS]
        self._target_s = [config.tiers[t].ttft_target_s for t in ALL_TIERS]

    def _choose(self, now: float) -> tuple[Tier, bool] | None:
        """(tier to serve, whether in fair order)."""
        sfq = self._sfq
        if sfq.count(Tier.P0):
            return Tier.P0, False
        urgent = self._aged(now)
        if urgent is None:
            urgent = self._rescued(now)
        if urgent is not None:
            return urgent, False
        # P3 is best effort: it competes only while no P1 request waits.
        eligible = FAIR_TIERS if sfq.count(Tier.P1) else FAIR_TIERS_WITH_P3
        fair = sfq.best(eligible)
        return None if fair is None else (fair, True)

    def _aged(self, now: float) -> Tier | None:
        """The tier of the oldest head past its aging threshold, unless a more urgent
        tier's head is older still (aging never overtakes an older, more urgent request)."""
        aged: Tier | None = None
        oldest = 0.0
        for tier in FAIR_TIERS_WITH_P3:
            head = self._sfq.head_of(tier)
            if head is None or now - head.arrival_time <= self._aging_s[tier]:
                continue
            if aged is None or head.arrival_time < oldest:
                aged, oldest = tier, head.arrival_time
        if aged is None:
            return None
        for tier in FAIR_TIERS[: aged - 1]:
            head = self._sfq.head_of(tier)
            if head is not None and head.arrival_time <= oldest:
                return None
        return aged

    def _rescued(self, now: float) -> Tier | None:
        """The P1-P2 head past half its TTFT target with the earliest deadline, if any."""
        rescue: Tier | None = None
        deadline = 0.0
        for tier in FAIR_TIERS:
            head = self._sfq.head_of(tier)
            if head is None or now - head.arrival_time <= RESCUE_FRACTION * self._target_s[tier]:
                continue
            due = head.arrival_time + self._target_s[tier]
            if rescue is None or due < deadline:
                rescue, deadline = tier, due
        return rescue

    def peek(self, now: float) -> Request | None:
        choice = self._choose(now)
        return None if choice is None else self._sfq.head_of(choice[0])

    def _pop(self, now: float) -> Request:
        choice = self._choose(now)
        if choice is None:
            raise EmptyQueueError("pop from an empty queue")
        tier, in_order = choice
        return self._sfq.serve(tier, in_order=in_order)

    def _push(self, req: Request, now: float) -> None:
        self._sfq.append(req)

    def _push_front(self, req: Request, now: float) -> None:
        self._sfq.appendleft(req)

    def _remove(self, req: Request) -> None:
        self._sfq.remove(req)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._sfq)

    def preempts_for_admission(self, req: Request, memory: KVCacheManager, num_blocks: int) -> bool:
        # P0 may always reclaim; other tiers only to take back their own floor and reserve.
        return req.tier == Tier.P0 or memory.within_entitlement(req.tier, num_blocks)

    def admission_victim_ok(self, req: Request, victim: Request, memory: KVCacheManager) -> bool:
        if victim.tier <= req.tier:
            return False
        return req.tier == Tier.P0 or memory.is_borrowing(victim.tier)
