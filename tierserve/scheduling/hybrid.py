"""The production policy: P0 strict with reserved memory and the right to reclaim; P1
ahead of P2, with an SLO rescue; P2 and P3 by weighted fair queuing; aging so nothing
waits forever.

Order of service: P0; then the rescue of P1; then aged requests; then the rest of P1 in
its tenant-fair order; then the rescue of P2; then P2 and P3 in their fair order. Under
overload the loss thus falls on P3, then P2, and P1 degrades last (issue 13).

P1 used to share the GPUs with P2 by weight (the design's "P1-P2 by wfq") until a P1
request was at risk. Beyond capacity that put the loss on P1 before P2: the P1 requests
already late waited behind P2's rescue and fair share, and at 1.2x capacity with bursty
arrivals P1's P95 TTFT was 244 s (P2's 200 s). Served ahead of P2, P1's P95 there is
26 s, more P1 requests meet their target (87 % against 85 %) and, since P1's rescue still
comes first, so does the goodput of all tiers; P2 keeps its aging threshold, so it is
delayed, never starved.

The rescue of a tier serves its requests that have waited over a quarter of their TTFT
target but can still meet it (they have waited less than the whole target): in the
tier's tenant-fair order, the oldest such request of the first tenant (by start tag) that
has one (`overdue.py`; with one tenant, the tier's oldest such request). Four choices
decide what happens beyond capacity (issue 13):
- a tier is judged by its oldest waiting request, not by its fair head: inside a tier the
  tenant-fair order puts a returning tenant's fresh request first, and judged by that head
  a backlogged tier looked in no danger while its other requests waited a minute;
- the request rescued is picked in the tenant-fair order among those that can be saved:
  the tier's oldest across tenants handed a tier under a queue that stays long to the
  tenant sending the most, whatever the weights, and the tier's fair head is often a
  request past saving;
- a request that has already missed its target gains nothing from going first, while
  every request served ahead of it that can still make its target counts. So under
  sustained overload the requests that can still make it are served first, and the late
  ones follow in the tier's fair order. P1 then meets its
  target for as many requests as the GPUs can serve in time, instead of every request of
  a growing queue missing it a little (first come, first served);
- the scheduler admits no prompt that a capped step leaves without a token
  (`StepBudget.has_prefill_room`), so the queue order, not the order of prefills inside
  the seats, decides who runs, and no seat is held by a request doing nothing.

P0 prompts prefill ahead of every other tier's chunks, and among themselves the shortest
remaining first (`prefill_chunk_cap`): on the public traces a P0 prompt of a few hundred
tokens otherwise waited seconds behind another P0's prefill of tens of thousands, and
the P95 of P0's per-request slowdown was 9x on Mooncake at half its rate (2x after). A
longer P0 prompt's chunk in a step with a shorter one is held to the step bound in time
too (priced at its context): deep into a prompt of 50,000 tokens a chunk of the step's
remaining tokens took 0.4 s, and the shorter prompt's first token waited for it.

Running prompts prefill before anyone is admitted, and a P1 or P2 request at the queue's
head that would wait past RESCUE_FRACTION of its target behind lower tiers' running
prompts gets its first chunk ahead of theirs (`_head_kept_for`): on the Mooncake trace a
P1 request waited 10 s behind a P2 prompt of 60,000 tokens.

P3 steps aside while a P1 or P2 request that can still meet its target has waited over
a third of it (DEFER_FRACTION, judged once a pass in `begin_step`): P3 is neither aged nor
given its fair share ahead of P2, a P1 or P2 request short of a seat takes a running P3
request's (the P3 one is preempted, by swap or recompute as the cost rule says), and a P3
request swapped out stays out. At 1.2x capacity (default workload, Poisson) P3 requests
admitted while the queue was still short otherwise held their seats through the overload
(a P3 answer is thousands of tokens), and P2's attainment was 75 and 58 % (seeds 0 and
1) where SGLang's priority scheduler, which preempts them, kept 96 and 79 %; with the rule
it is 89 and 72 %. The threshold is a third, not any wait: under a deep, steady overload
(512 closed-loop clients) P2 meets its target whether or not P3 runs, and a P3 request
deferred whenever anything waited was shed after `p3_shed_after_s` (63 of 215), which
cost goodput and throughput; at a quarter 46 were shed, at a third none. Over seeds 0-2
at 1.2x (P0-only steps for P0 at risk) a third gave goodput 8.18 requests/s, a half
8.13. The vLLM plug-in does not call `begin_step`, so there P3 never steps aside this way.

Beyond the queue, hybrid shapes each step (`hybrid_step.py`: a step-time bound while a
P0 is likely, P0-only prefill steps, background yields), lets P0 take a seat or memory
from lower tiers, sheds P3 requests that have waited `p3_shed_after_s` while more urgent
tiers are backlogged (with the reason on the request), and preempts each victim by
whichever of swap and recompute costs less (the engine's cost rule, `swap_factor`).
Its settings are `[policy.hybrid]`.

Aging is evaluated on every scheduling pass (not at enqueue, when the wait is ~0): a tier
whose oldest request has waited longer than the tier's `aging_s` is served ahead of the
fair order, right after P1's rescue — unless a more urgent tier's oldest request has
waited longer still, so aging never lets a request overtake an older, more urgent one
(under overload every tier ages, and the lower tiers' shorter thresholds would otherwise
invert the priorities). The aged request served is picked as the rescue's is, in the
tenant-fair order, except that a tenant with an aged request not served for
HELD_BACK_AGINGS x `aging_s` goes first (new tenants, each starting at the fair queue's
virtual time, would otherwise hold back a tenant served before for good), and a pick that
would overtake an older, more urgent request gives way to the tier's oldest (so while a
more urgent tier's queue is as old as this one's, aging serves near arrival order and the
tenants' weights count for little). It changes the order only — memory is
always accounted to the tier the tenant is entitled to, so an aged P1 never holds P0's
floor.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from tierserve.config import ConfigError, EngineConfig, PolicyOptions
from tierserve.request import Request
from tierserve.request import prefilling as prefilling_of
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.scheduling.hybrid_step import StepShaper, tokens_left
from tierserve.scheduling.oldest import OldestWaiting
from tierserve.scheduling.overdue import OverdueByTenant
from tierserve.scheduling.sfq import TierFairQueues
from tierserve.scheduling.step import StepBudget, StepEstimate, tokens_at_context_within
from tierserve.scheduling.wfq import FairQueuePolicy, expected_cost
from tierserve.tiers import ALL_TIERS, Tier

if TYPE_CHECKING:
    from tierserve.memory.manager import KVCacheManager

RESCUE_FRACTION = 0.25  # of the TTFT target a P1-P2 request may wait before it is rescued
DEFER_FRACTION = 1 / 3  # ... and before P3 steps aside for it
P0_FLOOR_SHARE = 1 / 8  # of a step's tokens a P0 prompt keeps while shorter P0 prompts go first
HELD_BACK_AGINGS = 10  # a tenant with an aged request not served for this many `aging_s` goes first
RESCUED_TIERS = (Tier.P1, Tier.P2)  # rescued when at risk
AGED_TIERS = (Tier.P1, Tier.P2, Tier.P3)  # aged


class Choice(NamedTuple):
    tier: Tier
    request: Request | None  # a rescued or aged request, served itself; None: the tier's head
    in_order: bool  # served in the fair order (advances its virtual time)


def _drop_seq(seqs: list[int], seq: int) -> bool:
    """Take `seq` out of the ascending `seqs`; whether a later one stays. vLLM puts back what
    it skips latest first, so `seq` is nearly always the last."""
    if seqs and seqs[-1] == seq:
        seqs.pop()
        return False
    seqs.pop(bisect.bisect_left(seqs, seq))
    return True


class Popped(NamedTuple):
    """What a pop changed beyond the queues, for `put_back` (with `keep_undo`)."""

    requeued_at: float | None  # back in the queue since, after a preemption
    held_since: float | None  # its tenant's held-back time in the aged tier (None: not held)
    p0_tokens: int | None  # a P0 prompt's admission record (None: not P0) ...
    dropped_p0: int | None  # ... and the recent P0 prompt it pushed out
    seq: int  # its place among the pass's pops


@dataclass(frozen=True)
class HybridOptions(PolicyOptions):
    step_bound_s: float = 0.15  # predicted step duration P1-P3 prefill may fill while a P0 is likely
    step_bound_from_slack: bool = True  # ... or more: P0's target less its longest recent prompt alone
    p0_step_tokens: int = 2048  # ... and at most this many tokens of it
    step_bound_x_p0: float = math.inf  # ... and at most this multiple of a recent P0 prompt's time alone
    p0_likely_s: float = 60.0  # a P0 is likely for this long after a P0 arrival (inf: always)
    p0_solo_prefill: bool = True  # a step that prefills P0 runs P0 work only (at most half the steps)
    p0_solo_share: float = 0.75  # ... if, sharing it, a P0 prompt would pass this share of its TTFT target
    p3_yields: bool = True  # a P0-P2 prefill step leaves P3 out (prompts <= 1/2, decodes <= 1/4) ...
    p3_yield_wait_share: float = 0.0  # ... while a P0 waits or a P1/P2 one waited this share of its target
    p3_shed_after_s: float = 300.0  # shed a P3 request waiting this long while P1/P2 wait (inf: never)

    def check(self, path: str) -> None:
        for name in (
            "step_bound_s",
            "step_bound_x_p0",
            "p0_likely_s",
            "p3_shed_after_s",
            "p0_solo_share",
            "p3_yield_wait_share",
        ):
            value = getattr(self, name)
            if not value >= 0:
                raise ConfigError(f"{path}.{name}: must be >= 0, got {value}")
        if self.p0_step_tokens < 1:
            raise ConfigError(f"{path}.p0_step_tokens: must be >= 1, got {self.p0_step_tokens}")


class HybridPolicy(FairQueuePolicy):
    name: ClassVar[str] = "hybrid"
    options_type: ClassVar[type[PolicyOptions] | None] = HybridOptions
    leaps_decodes: ClassVar[bool] = True  # nothing to shed or cap; `end_step` keeps history
    leaps_while_waiting: ClassVar[bool] = True
    holds_tiers: ClassVar[bool] = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.options = config.options(self.name, HybridOptions)
        self._shaper = StepShaper(
            self.options, config.scheduler.max_num_batched_tokens, config.tiers[Tier.P0].ttft_target_s
        )
        weights = [config.tiers[t].wfq_weight for t in ALL_TIERS]
        self._sfq = TierFairQueues(weights, expected_cost)
        self._aging_s = [config.tiers[t].aging_s for t in ALL_TIERS]
        self._target_s = [config.tiers[t].ttft_target_s for t in ALL_TIERS]
        self._waiting = OldestWaiting()  # every waiting request: aging
        # Those that can still meet their target: whether a tier is at risk (`_at_risk`), by
        # a lazy peek. Asking the rescue's lists instead moved the newly overdue requests into
        # their tenants' heaps on every pass: hybrid's P99 pass 5.2-5.6 ms against 1.4
        # (`tierserve bench overhead`, 2026-12-07), results the same.
        self._savable = OldestWaiting()
        # The rescue's and aging's requests, by tenant: each is served in its tier's tenant-fair order.
        self._rescuable = {
            t: OverdueByTenant(RESCUE_FRACTION * self._target_s[t], self._target_s[t]) for t in RESCUED_TIERS
        }
        # A tenant with an aged request that has not been served for HELD_BACK_AGINGS x
        # `aging_s` goes first: fair queuing alone lets new tenants hold one back for good.
        self._aged_by_tenant = {
            t: OverdueByTenant(self._aging_s[t], starve_s=HELD_BACK_AGINGS * self._aging_s[t])
            for t in AGED_TIERS
            if math.isfinite(self._aging_s[t])
        }
        self._p0_waiting = OldestWaiting(key=tokens_left)  # waiting P0 prompts, shortest first
        self._requeued_at: dict[Request, float] = {}  # preempted by recompute: back in the queue since
        # With `keep_undo`: what each pop of the pass changed, for `put_back` to restore.
        self._popped: dict[Request, Popped] = {}
        # The places of the pops on record, by (tier, tenant) and of P0's, ascending: whether
        # a pop of the same tenant and tier, or a P0's, ran after one put back, without a walk
        # over the pass's pops (a backlog that vLLM skipped was put back in time quadratic in
        # its length: 0.2 s for 4,000).
        self._popped_seqs: dict[tuple[Tier, str], list[int]] = {}
        self._p0_popped_seqs: list[int] = []
        self._pop_seq = 0
        # Waiting P3 requests, longest in the queue first (since arrival or since `_requeued_at`).
        self._queued = OldestWaiting(key=self._queued_since)
        self._step: StepBudget | None = None  # the step being built, between the hooks
        self._p0_by_length: list[Request] = []  # this step's P0 prompts, shortest first
        self._p0_floor_tokens = max(1, int(config.scheduler.max_num_batched_tokens * P0_FLOOR_SHARE))
        self._deferred = False  # P3 steps aside in this pass (set by `begin_step`)
        self._held: set[Tier] = set()  # tiers set aside for the rest of the pass (`hold_tier`)
        # A pass kept a step's tokens for waiting P0 prompts, admitted none and left tokens
        # unused: they are not kept again until a P0 request comes in, none waits, a running
        # one ends or leaves, or the P0 prompt next in line could come in where it could not
        # (`_still_stuck`).
        self._p0_stuck = False
        self._p0_running_when_stuck: int | None = None  # P0 requests running then
        self._p0_head_could_when_stuck = True  # whether `first_chunk` let the P0 head in then
        self._p0_kept_for = False  # this pass keeps tokens for waiting P0 prompts
        # The waiting P1 or P2 request the queue serves next, for which this pass's running
        # prompts of lower tiers leave its first chunk (`_head_kept_for`), where it could
        # come in: asked of `_first_chunk` when a lower tier's chunk is sized (choosing
        # victims writes out the fast simulation's kept decoders, which `begin_step` may not
        # do), and asked again once the running or swapped requests change in the pass.
        self._head: Request | None = None
        self._first_chunk: Callable[[Request], int | None] | None = None

    def _choose(self, now: float) -> Choice | None:
        sfq, held = self._sfq, self._held
        if sfq.count(Tier.P0) and Tier.P0 not in held:
            return Choice(Tier.P0, None, in_order=False)
        for urgent in (self._rescue(Tier.P1, now), self._aged(now)):
            if urgent is not None:
                return Choice(urgent.tier, urgent, in_order=False)
        # Under overload the loss falls on P3, then P2: P1 goes first, in its fair order.
        if sfq.count(Tier.P1) and Tier.P1 not in held:
            return Choice(Tier.P1, None, in_order=True)
        rescued = self._rescue(Tier.P2, now)
        if rescued is not None:
            return Choice(Tier.P2, rescued, in_order=False)
        if self._deferred and sfq.count(Tier.P2) and Tier.P2 not in held:
            return Choice(Tier.P2, None, in_order=True)
        fair = sfq.best([t for t in (Tier.P2, Tier.P3) if t not in held] if held else (Tier.P2, Tier.P3))
        return None if fair is None else Choice(fair, None, in_order=True)

    def hold_tier(self, tier: Tier) -> None:
        self._held.add(tier)

    def release_held(self) -> None:
        self._held.clear()

    def _rescue(self, tier: Tier, now: float) -> Request | None:
        """The request of `tier` to rescue: one that has waited over RESCUE_FRACTION of its
        TTFT target and can still meet it, the oldest such request of the first tenant in
        the tier's tenant-fair order that has one (the tier's oldest would hand the tier to
        the tenant sending the most, whatever the weights, under a queue that stays long)."""
        if tier in self._held or not self._sfq.count(tier):
            return None
        return self._rescuable[tier].pick(now, self._sfq.tenants(tier).start_tag)

    def _at_risk(self, tier: Tier, now: float, fraction: float) -> bool:
        """Whether a waiting request of `tier` that can still meet its TTFT target has
        waited over `fraction` of it."""
        if tier in self._held or not self._sfq.count(tier):
            return False
        target = self._target_s[tier]
        req = self._savable.oldest(tier, arrived_after=now - target)
        return req is not None and now - req.arrival_time > fraction * target

    def _aged(self, now: float) -> Request | None:
        """A request past its tier's aging threshold: in the tier whose oldest such request
        is the oldest, unless a more urgent tier's oldest is older still (aging never
        overtakes an older, more urgent request); in that tier, the oldest aged request of
        the first tenant in the tier's tenant-fair order that has one (or of a tenant held
        back HELD_BACK_AGINGS x `aging_s`), unless that overtakes an older, more urgent
        request: then the tier's oldest."""
        aged: Request | None = None
        for tier in AGED_TIERS:
            if (tier is Tier.P3 and self._deferred) or tier in self._held:
                continue
            oldest = self._waiting.oldest(tier)
            if oldest is None or now - oldest.arrival_time <= self._aging_s[tier]:
                continue
            if aged is None or oldest.arrival_time < aged.arrival_time:
                aged = oldest
        if aged is None:
            return None
        before = self._oldest_more_urgent(aged.tier)
        if aged.arrival_time >= before:
            return None
        picked = self._aged_by_tenant[aged.tier].pick(now, self._sfq.tenants(aged.tier).start_tag)
        return aged if picked is None or picked.arrival_time >= before else picked

    def _oldest_more_urgent(self, tier: Tier) -> float:
        """The arrival time of the oldest waiting request of the tiers P1-P2 more urgent
        than `tier` (inf: none waits)."""
        oldest_s = math.inf
        for urgent in RESCUED_TIERS[: tier - 1]:
            oldest = self._waiting.oldest(urgent)
            if oldest is not None and oldest.arrival_time < oldest_s:
                oldest_s = oldest.arrival_time
        return oldest_s

    def peek(self, now: float) -> Request | None:
        choice = self._choose(now)
        if choice is None:
            return None
        return choice.request or self._sfq.head_of(choice.tier)

    def _pop(self, now: float) -> Request:
        choice = self._choose(now)
        if choice is None:
            raise EmptyQueueError("pop from an empty queue")
        aged = self._aged_by_tenant.get(choice.tier)
        if aged is not None:  # which tenants have an aged request, as of now, whoever looked last
            aged.advance(now, self._sfq.tenants(choice.tier).start_tag)
        req = choice.request
        if req is None:
            req = self._sfq.serve(choice.tier, in_order=choice.in_order)
        else:
            self._sfq.take(req)
        held_since = aged.held_since(req.tenant) if aged is not None and self.keeps_undo else None
        requeued_at = self._requeued_at.get(req)
        self._untrack(req)
        if aged is not None:
            aged.served(req, now)
        p0_tokens = dropped_p0 = None
        if req.tier == Tier.P0:  # popped once admitted: its cached prefix is known
            p0_tokens = tokens_left(req)
            dropped_p0 = self._shaper.p0_admitted(p0_tokens)
        if self.keeps_undo:
            self._pop_seq += 1
            self._popped[req] = Popped(requeued_at, held_since, p0_tokens, dropped_p0, self._pop_seq)
            self._popped_seqs.setdefault((req.tier, req.tenant), []).append(self._pop_seq)
            if req.tier == Tier.P0:
                self._p0_popped_seqs.append(self._pop_seq)
        return req

    def _push(self, req: Request, now: float) -> None:
        if req.tier == Tier.P0:
            self._shaper.last_p0_arrival = now
        super()._push(req, now)
        self._track(req)

    def _push_front(self, req: Request, now: float) -> None:
        self._requeued_at[req] = now  # before `_track`, which files it by it
        super()._push_front(req, now)
        self._track(req)

    def _put_back(self, req: Request, now: float) -> None:
        super()._put_back(req, now)
        popped = self._popped.pop(req, None)
        same_tenant_ran = p0_ran = False
        if popped is not None:  # what of the pass's later pops is still on record: they ran
            same_tenant_ran = _drop_seq(self._popped_seqs[req.tier, req.tenant], popped.seq)
            if req.tier == Tier.P0:
                _drop_seq(self._p0_popped_seqs, popped.seq)
            p0_ran = bool(self._p0_popped_seqs) and self._p0_popped_seqs[-1] > popped.seq
        if popped is not None and popped.requeued_at is not None:
            self._requeued_at[req] = popped.requeued_at  # before `_track`, which files it by it
        self._track(req)
        start_tag = self._sfq.tenants(req.tier).start_tag  # its tenant's, now back down
        for overdue in (self._rescuable.get(req.tier), self._aged_by_tenant.get(req.tier)):
            if overdue is not None:
                overdue.tag_lowered(req.tenant, start_tag)
        if popped is None:
            return
        aged = self._aged_by_tenant.get(req.tier)
        if aged is not None and popped.held_since is not None and not same_tenant_ran:
            aged.hold_back_since(req, popped.held_since)  # else a serve of its tenant ran since
        if popped.p0_tokens is not None:
            if p0_ran:  # a later P0 record stays
                self._shaper.p0_not_admitted_once(popped.p0_tokens, popped.dropped_p0)
            else:
                self._shaper.p0_not_admitted(popped.dropped_p0)

    def forget_undo(self) -> None:
        super().forget_undo()
        self._popped.clear()
        self._popped_seqs.clear()
        self._p0_popped_seqs.clear()

    def _remove(self, req: Request) -> None:
        super()._remove(req)
        self._untrack(req)

    def _track(self, req: Request) -> None:
        """Note a waiting request where aging (P1-P3), the rescue (P1-P2) and the P0
        prompt order look for it."""
        if req.tier == Tier.P0:
            self._p0_waiting.add(req)
        if req.tier in AGED_TIERS:
            self._waiting.add(req)
        if req.tier is Tier.P3:
            self._queued.add(req)
        if req.tier in RESCUED_TIERS:
            self._savable.add(req)
            self._rescuable[req.tier].add(req)
        aged = self._aged_by_tenant.get(req.tier)
        if aged is not None:
            aged.add(req, self._requeued_at.get(req))

    def _untrack(self, req: Request) -> None:
        self._p0_waiting.discard(req)
        self._queued.discard(req)
        self._requeued_at.pop(req, None)
        self._waiting.discard(req)
        if req.tier in RESCUED_TIERS:
            self._savable.discard(req)
            self._rescuable[req.tier].discard(req)
        aged = self._aged_by_tenant.get(req.tier)
        if aged is not None:
            aged.discard(req)

    def preempts_for_admission(self, req: Request, memory: KVCacheManager, num_blocks: int) -> bool:
        # P0 may always reclaim; other tiers only to take back their own floor and reserve.
        return req.tier == Tier.P0 or memory.within_entitlement(req.tier, num_blocks)

    def admission_victim_ok(self, req: Request, victim: Request, memory: KVCacheManager) -> bool:
        if victim.tier <= req.tier:
            return False
        return req.tier == Tier.P0 or memory.is_borrowing(victim.tier)

    def preempts_for_seat(self, req: Request) -> bool:
        # P0 never waits for a seat held by a lower tier, nor P1 and P2 for one held by P3
        # while P3 steps aside.
        return req.tier == Tier.P0 or (req.tier != Tier.P3 and self._deferred)

    def seat_victim_ok(self, req: Request, victim: Request, memory: KVCacheManager) -> bool:
        return victim.tier > req.tier and (req.tier == Tier.P0 or victim.tier == Tier.P3)

    def returns_first(self, swapped: Request, head: Request) -> bool:
        return swapped.tier <= head.tier and self.may_swap_in(swapped)

    def may_swap_in(self, swapped: Request) -> bool:
        return swapped.tier != Tier.P3 or not self._deferred

    def _p1_p2_in_danger(self, now: float) -> bool:
        """Whether a waiting P1 or P2 request that can still meet its target has waited
        over DEFER_FRACTION of it."""
        return any(self._at_risk(tier, now, DEFER_FRACTION) for tier in RESCUED_TIERS)

    # ---- the step ------------------------------------------------------------------------

    def to_shed(self, now: float) -> list[tuple[Request, str]]:
        """P3 requests that have waited in the queue over `p3_shed_after_s` while P1 or P2
        requests wait too: the engine is full, and the loss falls on the background tier
        first."""
        limit = self.options.p3_shed_after_s
        sfq = self._sfq
        # The wait is in the queue, since the request came back to it where it was preempted
        # by recompute: a P3 answer that had run for minutes was shed the moment it lost its
        # seat, its tokens thrown away, as if it had waited all that time.
        longest = self._queued.oldest(Tier.P3)
        if longest is None or now - self._queued_since(longest) <= limit:
            return []
        if not (sfq.count(Tier.P1) or sfq.count(Tier.P2)):
            return []
        reason = f"overload: waited over {limit:g} s while P1/P2 requests waited"
        return [(r, reason) for r in self if r.tier is Tier.P3 and now - self._queued_since(r) > limit]

    def _queued_since(self, req: Request) -> float:
        return self._requeued_at.get(req, req.arrival_time)

    def begin_step(
        self,
        step: StepBudget,
        running: Sequence[Request],
        now: float,
        prefilling: Sequence[Request] | None = None,
        first_chunk: Callable[[Request], int | None] | None = None,
    ) -> None:
        self._step = step
        self._held.clear()
        self._deferred = self._p1_p2_in_danger(now)
        if prefilling is None:
            prefilling = prefilling_of(running)  # one scan of the running
        if self._p0_stuck:
            self._p0_stuck = self._still_stuck(running)
            if not self._p0_stuck:  # counted afresh if it sticks again (`end_step`): kept as it
                self._p0_running_when_stuck = None  # was, a P0 that had ended lifted it every pass
        self._p0_kept_for = not self._p0_stuck and bool(self.num_waiting(Tier.P0))
        self._p0_by_length = self._p0_prompts(prefilling, waiting=self._p0_kept_for)
        p0_prefilling = any(r.tier is Tier.P0 for r in prefilling)
        num_decodes = len(running) - len(prefilling)
        self._shaper.begin(step, self.num_waiting(Tier.P0), p0_prefilling, num_decodes, now)
        self._head = self._head_kept_for(step, prefilling, now)  # after the cap
        self._first_chunk = first_chunk

    def _head_kept_for(self, step: StepBudget, prefilling: Sequence[Request], now: float) -> Request | None:
        """The queue's next request where it is P1 or P2, has no first token yet, can still
        meet its TTFT target and would wait past RESCUE_FRACTION of it for the running
        prompts of lower tiers: those prompts' chunks leave it its first chunk where it could
        come in in this pass (`_room_beside_head`). Prefilled first, as running requests
        are, a P2 prompt of 60,000 tokens took every step's tokens for 30 steps while a P1
        request that had arrived after it waited 10 s for its first one. A shorter wait is
        left alone: a P1 request that meets its target anyway gains nothing from going
        first, and the prompts it overtakes lose (on the default workload, whose P2 prompts
        take a step or two, P2's attainment fell and nobody's rose)."""
        if not prefilling or self._p0_kept_for:
            return None
        head = self.peek(now)
        if head is None or head.tier not in RESCUED_TIERS or head.first_token_time is not None:
            return None
        behind = sum(tokens_left(r) for r in prefilling if r.tier > head.tier)
        if not behind:
            return None
        waited_s, target_s = now - head.arrival_time, self._target_s[head.tier]
        if waited_s >= target_s:
            return None
        if step.estimate_s is not None:
            budget = step.tokens_left  # of fresh tokens: a deep chunk costs more, which this ignores
            if step.capped_tiers and head.tier + 1 in step.capped_tiers:  # P1-P3 share a cap
                budget = min(budget, step.capped_tokens_left)
            behind_s = math.ceil(behind / max(1, budget)) * step.estimate_s(budget, 0)
            if waited_s + behind_s <= RESCUE_FRACTION * target_s:
                return None
        return head

    def _room_beside_head(self, req: Request, step: StepBudget) -> int | None:
        """The most of the step `req`'s chunk may take where it is of a lower tier than the
        waiting head (`_head_kept_for`) and the head is not in the step yet: what leaves
        the head its first chunk, of the step's tokens and of the capped share where both
        tiers are capped (while a P0 is likely P1-P3 share one). None: no head to leave
        room for, or it could not come in in this pass (`first_chunk`; without one, as where
        no engine builds the step, nothing is kept)."""
        head = self._head
        if head is None or req.tier <= head.tier or head in step.prefills:
            return None
        first_chunk = self._first_chunk
        keep = None if first_chunk is None else first_chunk(head)
        if keep is None:
            return None
        cap = super().prefill_chunk_cap(head)
        if cap is not None:
            keep = min(cap, keep)
        room = max(0, step.tokens_left - keep)
        if req.tier in step.capped_tiers and head.tier in step.capped_tiers:
            # Without the cap's floor: a chunk deep into a long prompt is charged at its
            # context, and with the floor it took the whole share, the head found no
            # token in it, and pass after pass the prompt lost tokens for nothing.
            share = step.capped_tokens_left - keep
            room = min(room, step.capped_chunk(req, share, at_least=False))
        return room

    def _still_stuck(self, running: Sequence[Request]) -> bool:
        """Whether waiting P0 prompts still go without kept tokens: until one comes in, none
        waits, a running P0 request ends or leaves (its blocks may be the room they wait
        for: a P0 prompt waiting on another P0 request's blocks once waited for a whole
        lower-tier prefill after they were freed), or the P0 prompt next in line could come
        in where it could not when P0 was set aside (`end_step`)."""
        if not self.num_waiting(Tier.P0):
            return False
        p0 = Tier.P0
        num_running = sum(1 for r in running if r.tier is p0)
        if self._p0_running_when_stuck is None or num_running > self._p0_running_when_stuck:
            self._p0_running_when_stuck = num_running
        return num_running >= self._p0_running_when_stuck

    def end_step(self, step: StepBudget, now: float) -> None:
        self._shaper.end(step, self._more_urgent_queued(now), now)
        p0_in = any(r.tier is Tier.P0 for r in step.fresh)  # admitted or swapped in
        if p0_in:
            self._p0_stuck = False
        elif self._p0_kept_for and self.num_waiting(Tier.P0) and step.has_prefill_room(Tier.P0):
            # Tokens kept for a P0 prompt that could not come in (its tier over its ceiling,
            # say, where blocks charged to P0 are held by a lower tier's prompt that only
            # these tokens would finish): kept again, pass after pass, the engine stopped.
            # Not where the step's tokens all went to work (decodes, P0 prompts' chunks: a
            # shorter P0 prompt running ahead of it): set aside then, a P0 prompt waiting
            # behind another's prefill lost its kept tokens to lower tiers' chunks until
            # that request had ended.
            self._p0_stuck = True
            # A P0 prompt refused at its ceiling in this pass (`hold_tier`) counts as one
            # that could not come in, whatever the check says now: where the other tiers
            # took the last seats since, the seat's victim left to it was the holder of the
            # blocks charged to P0, it read as one that could, and the lift never came.
            held = Tier.P0 in self._held
            self._p0_head_could_when_stuck = not held and self._p0_head_could_come_in() is not False
        elif self._p0_stuck and not self._p0_head_could_when_stuck and self._p0_head_could_come_in():
            # P0 over its ceiling until a lower tier's prompt holding blocks charged to P0
            # ended: the P0 prompt could come in then, yet nothing was kept for it, and a long
            # P2 prompt's chunks took every step while it waited. Asked here, once the pass's
            # decodes are placed (where the fast simulation may write its kept decoders out,
            # as admission's victim choice does), for the next pass.
            self._p0_stuck = False
        if not self._p0_stuck:
            self._p0_running_when_stuck = None
        self._step, self._p0_by_length, self._head, self._first_chunk = None, [], None, None
        self._held.clear()

    def _p0_head_could_come_in(self) -> bool | None:
        """Whether the P0 prompt next in line could come in as seats and memory stand (the
        engine's `first_chunk`), or None where nothing can say."""
        head, first_chunk = self._sfq.head_of(Tier.P0), self._first_chunk
        if head is None or first_chunk is None:
            return None
        return first_chunk(head) is not None

    def _more_urgent_queued(self, now: float) -> bool:
        """Whether, after this pass, a P0 request still waits, or a P1 or P2 one that has
        waited `p3_yield_wait_share` of its TTFT target or more (0, the default: any P1/P2
        request waits; above 0, a queue rather than the moment's arrivals, which the next
        step admits anyway)."""
        if self.num_waiting(Tier.P0):
            return True
        share = self.options.p3_yield_wait_share
        for tier in RESCUED_TIERS:
            oldest = self._waiting.oldest(tier)
            if oldest is not None and now - oldest.arrival_time >= share * self._target_s[tier]:
                return True
        return False

    def prefill_cap(
        self, decode_tokens: int, p0_prefilling: bool, now: float, estimate_s: StepEstimate | None
    ) -> int | None:
        # The vLLM plug-in's question: the engine's own passes cap in `begin_step`.
        num_p0_waiting = self.num_waiting(Tier.P0)
        return self._shaper.prefill_cap(num_p0_waiting, p0_prefilling, decode_tokens, now, estimate_s)

    def solo_tier(self, tiers_prefilling: AbstractSet[Tier]) -> Tier | None:
        # The engine's P0-only prefill steps (`p0_solo_prefill`), same window of steps.
        return Tier.P0 if self._shaper.solo(Tier.P0 in tiers_prefilling) else None

    def _p0_prompts(self, prefilling: Sequence[Request], *, waiting: bool = True) -> list[Request]:
        """The P0 prompts with tokens left to prefill, running (among `prefilling`) or
        waiting (unless not `waiting`), shortest first: the waiting ones only as far as a
        step's tokens reach (those beyond go after every listed one, and `_ahead_of` treats
        them so)."""
        p0 = Tier.P0  # `is`: an IntEnum's == costs five times as much
        prompts = [r for r in prefilling if r.tier is p0]
        if waiting and self.num_waiting(Tier.P0):
            budget, total = self.config.scheduler.max_num_batched_tokens, 0

            def enough(req: Request) -> bool:
                nonlocal total
                total += tokens_left(req)
                return total >= budget

            prompts.extend(self._p0_waiting.first(Tier.P0, enough))
        return sorted(prompts, key=lambda r: (tokens_left(r), r.arrival_time))

    def prefill_chunk_cap(self, req: Request) -> int | None:
        """P0 prompts prefill first, and among them the shortest remaining first: a first
        token of a short prompt must not wait for a long one's prefill, which can take
        seconds. A chunk leaves room in the step for the P0 prompts that go ahead of it
        and are not in the step yet (waiting ones are admitted after the running
        requests' chunks). A P0 prompt with a shorter one ahead of it is also held to the
        step bound in time, priced at its context (`_chunk_within_bound`): deep into a long
        prompt a few thousand tokens take far longer than the bound. A P0 prompt keeps
        P0_FLOOR_SHARE of the step, so a long one still moves."""
        cap = super().prefill_chunk_cap(req)
        step = self._step
        if step is None:
            return cap
        beside_head = self._room_beside_head(req, step)
        if beside_head is not None:
            cap = beside_head if cap is None else min(cap, beside_head)
        if not self._p0_by_length:
            return cap
        ahead = list(self._ahead_of(req))
        reserve = sum(tokens_left(r) for r in ahead if r not in step.prefills)
        if req.tier is Tier.P0 and ahead:
            # A shorter P0 prompt is in this step or joins it: this one's chunk is held to the
            # step bound in time too, so that the shorter one's first token does not wait for
            # a long chunk deep into a long prompt (priced at its context).
            room = min(step.tokens_left - reserve, self._chunk_within_bound(req, step))
            room = max(self._p0_floor_tokens, room)
        elif reserve == 0:
            return cap
        else:
            room = max(0, step.tokens_left - reserve)
        return room if cap is None else min(cap, room)

    def _chunk_within_bound(self, req: Request, step: StepBudget) -> int:
        """The most of `req`'s prompt one chunk can hold within the step bound, priced at
        its context."""
        most, estimate = tokens_left(req), step.estimate_s
        if estimate is None:
            return most
        return tokens_at_context_within(
            estimate, most, req.num_computed_tokens, self._shaper.bound_s(estimate)
        )

    def _ahead_of(self, req: Request) -> Iterator[Request]:
        """This step's P0 prompts that prefill before `req`: every one listed for a lower
        tier or a P0 prompt not listed, the shorter ones (ties: the older) for a listed P0."""
        for other in self._p0_by_length:
            if other is req:
                return
            yield other

    def steady_step(self) -> None:
        self._shaper.steady_step()
