"""One scheduling pass: which requests decode, which prefill chunks run, who is admitted,
who is preempted (and how), who comes back from swap.

Order within a pass: decodes of running requests (most protected first; when blocks run
out, victims come from the less protected ones), then swapped requests come back, then
prefill chunks of running requests, then new admissions in policy order. Every change
of state happens here, between steps; nothing leaves the batch while a step runs.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.executors.base import Executor, ScheduledSeq, StepBatch
from tierserve.memory.manager import Alloc, KVCacheManager
from tierserve.request import EventKind, Request, RequestStatus
from tierserve.scheduling.base import Policy
from tierserve.tiers import ALL_TIERS, Tier

# Step shaping (p0_solo_prefill, p3_yields): the work a rule leaves out of a step runs in
# at least half of any SHAPING_WINDOW steps, so that it is delayed, never starved.
SHAPING_WINDOW = 8


class PreemptMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass
class SchedulerOutput:
    batch: StepBatch
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[tuple[Request, PreemptMode]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        policy: Policy,
        memory: KVCacheManager,
        executor: Executor,
        clock: Clock,
    ) -> None:
        self.config = config
        self.policy = policy
        self.memory = memory
        self.executor = executor
        self.clock = clock
        self.running: list[Request] = []
        self.swapped: tuple[deque[Request], ...] = tuple(deque() for _ in ALL_TIERS)
        self._forced: list[Request] = []  # victims named from outside, taken at the next pass
        self._unsorted = False  # requests joined `running` since it was last put in policy order
        # Whether each of the last SHAPING_WINDOW steps was P0-only (p0_solo_prefill), and
        # whether each left P3's prompt chunks / decodes out (p3_yields).
        self._solo_history: deque[bool] = deque(maxlen=SHAPING_WINDOW)
        self._yield_history: deque[bool] = deque(maxlen=SHAPING_WINDOW)
        self._decode_yield_history: deque[bool] = deque(maxlen=SHAPING_WINDOW)
        self._last_p0_arrival = -math.inf

    def add(self, req: Request) -> None:
        if req.tier == Tier.P0:
            self._last_p0_arrival = self.clock.now()
        self.policy.add(req, self.clock.now())

    def request_preemption(self, req: Request) -> None:
        """Preempt a running request at the next step boundary."""
        self._forced.append(req)

    def num_swapped(self, tier: Tier | None = None) -> int:
        return sum(map(len, self.swapped)) if tier is None else len(self.swapped[tier])

    # ---- the pass ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config.scheduler
        now = self.clock.now()
        policy, memory = self.policy, self.memory
        out = SchedulerOutput(StepBatch())
        decodes: dict[Request, int] = {}  # request -> 1, in protection order
        prefills: dict[Request, int] = {}  # request -> chunk tokens
        fresh: set[Request] = set()  # admitted or swapped in during this pass: not victims
        budget = cfg.max_num_batched_tokens
        block_size = memory.block_size

        for req in self._forced:
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
                self._preempt(req, out, now)
        self._forced.clear()

        running = self.running
        if self._unsorted:
            running.sort(key=policy.running_key)
            self._unsorted = False

        # 1. Decodes, most protected first; a request that cannot grow takes blocks from
        #    the least protected requests after it, or yields its own.
        prefilling: list[Request] = []
        i = 0
        while i < len(running):
            req = running[i]
            num_tokens = len(req.token_ids)
            if num_tokens - req.num_computed_tokens != 1 or num_tokens == req.num_prompt_tokens:
                prefilling.append(req)
                i += 1
                continue
            if budget < 1:
                i += 1
                continue
            if num_tokens > len(req.block_ids) * block_size:
                status = memory.grow(req, num_tokens)
                while status is not Alloc.OK:
                    same_tier = status is Alloc.OVER_CEILING
                    victim = self._decode_victim(req, running[i + 1 :], same_tier=same_tier)
                    if victim is None:
                        break
                    running.remove(victim)
                    self._preempt(victim, out, now)
                    status = memory.grow(req, num_tokens)
                if status is not Alloc.OK:
                    running.pop(i)
                    self._preempt(req, out, now)
                    continue
            decodes[req] = 1
            budget -= 1
            i += 1

        # 2. Swapped requests come back before anything new of their tier is admitted.
        just_preempted = {r for r, _ in out.preempted}
        for tier in ALL_TIERS:
            queue = self.swapped[tier]
            while queue and len(running) < cfg.max_num_seqs:
                req = queue[0]
                if req in just_preempted:
                    break
                mapping = memory.swap_in(req)
                if isinstance(mapping, Alloc):
                    break
                queue.popleft()
                out.swap_in.extend(mapping)
                req.status = RequestStatus.RUNNING
                req.record(now, EventKind.SWAPPED_IN, f"{len(mapping)} blocks")
                running.append(req)
                self._unsorted = True
                fresh.add(req)
                if req.is_prefilling:
                    prefilling.append(req)
                elif budget >= 1 and memory.grow(req, req.num_tokens) is Alloc.OK:
                    decodes[req] = 1
                    budget -= 1

        # 3. Prefill chunks of running requests, in protection order. While a P0 request
        #    prefills, a policy that protects P0 keeps other tiers' chunks small.
        #    With p0_guard_s, steps stay that small for a while after each P0 arrival, so
        #    that the next P0 request finds a short step in flight.
        p0_pending = policy.shapes_steps and (
            policy.num_waiting(Tier.P0) > 0
            or any(r.tier == Tier.P0 for r in prefilling)
            or now - self._last_p0_arrival < cfg.p0_guard_s
        )
        others_left = cfg.p0_step_tokens if p0_pending else cfg.max_num_batched_tokens
        for req in prefilling:
            if budget < 1:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # taken as a victim after it was listed
            chunk = self._chunk(req, budget, others_left)
            if chunk < 1 or memory.grow(req, req.num_computed_tokens + chunk) is not Alloc.OK:
                continue
            prefills[req] = chunk
            budget -= chunk
            if req.tier != Tier.P0:
                others_left -= chunk

        # 4. Admissions in policy order.
        while budget >= 1 and len(running) < cfg.max_num_seqs:
            head = policy.peek(now)
            if head is None:
                break
            req = head
            if any(self.swapped[t] for t in range(req.tier + 1)):
                break
            if not policy.may_admit(req, memory):
                break
            status = memory.admit(req)
            if status is Alloc.NO_SPACE:
                status = self._reclaim_for(req, out, now, fresh)
                for victim, _ in out.preempted:
                    budget += decodes.pop(victim, 0) + prefills.pop(victim, 0)
            if status is not Alloc.OK:
                break
            popped = policy.pop(now)
            assert popped is req, "policy.pop() disagreed with policy.peek()"
            req.status = RequestStatus.RUNNING
            if req.admitted_time is None:
                req.admitted_time = now
                req.record(now, EventKind.ADMITTED, f"{req.num_cached_tokens} tokens cached")
            else:
                req.record(now, EventKind.READMITTED, f"{req.num_computed_tokens} tokens cached")
            running.append(req)
            self._unsorted = True
            fresh.add(req)
            chunk = self._chunk(req, budget, others_left)
            if chunk >= 1:
                prefills[req] = chunk
                budget -= chunk
                if req.tier != Tier.P0:
                    others_left -= chunk

        if policy.shapes_steps:
            if cfg.p0_solo_prefill:
                self._solo_p0(decodes, prefills)
            if cfg.p3_yields:
                self._p3_yields(decodes, prefills)

        # Victims preempted by recompute rejoin the queue only now, so that the policy's
        # order cannot shift between its peek and pop, nor re-admit them in this pass.
        for victim, mode in out.preempted:
            if mode is PreemptMode.RECOMPUTE:
                policy.prepend(victim, now)

        out.batch = StepBatch(
            [ScheduledSeq(r, 1) for r in decodes], [ScheduledSeq(r, n) for r, n in prefills.items()]
        )
        return out

    # ---- helpers -------------------------------------------------------------------------

    def _solo_p0(self, decodes: dict[Request, int], prefills: dict[Request, int]) -> None:
        """Make a step that prefills P0 a P0-only step: the first token then waits for P0's
        own prefill and nothing else, as it would on an idle engine. What is left out (every
        other tier's decodes and chunks) runs in the next step."""
        history = self._solo_history
        solo = sum(history) < SHAPING_WINDOW // 2 and any(r.tier == Tier.P0 for r in prefills)
        history.append(solo)
        if solo:
            for work in (decodes, prefills):
                for req in [r for r in work if r.tier != Tier.P0]:
                    del work[req]

    def _p3_yields(self, decodes: dict[Request, int], prefills: dict[Request, int]) -> None:
        """Let background work yield to first tokens: a step that prefills P0-P2 leaves out
        P3's prompt chunks (in at most half of any SHAPING_WINDOW steps) and P3's decodes (in
        at most a quarter, so P3's inter-token latency grows by at most 4/3)."""
        if not any(r.tier != Tier.P3 for r in prefills):
            self._yield_history.append(False)
            self._decode_yield_history.append(False)
            return
        for history, work, limit in (
            (self._yield_history, prefills, SHAPING_WINDOW // 2),
            (self._decode_yield_history, decodes, SHAPING_WINDOW // 4),
        ):
            yields = sum(history) < limit and any(r.tier == Tier.P3 for r in work)
            history.append(yields)
            if yields:
                for req in [r for r in work if r.tier == Tier.P3]:
                    del work[req]

    def _chunk(self, req: Request, budget: int, others_left: int) -> int:
        cfg = self.config.scheduler
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if req.tier != Tier.P0:
            n = min(n, others_left)
            if req.num_prompt_tokens > cfg.long_prompt_tokens:
                n = min(n, cfg.long_prompt_chunk_tokens)
        return n

    def _decode_victim(self, req: Request, after: list[Request], *, same_tier: bool) -> Request | None:
        candidates: Iterable[Request] = after
        if same_tier:
            candidates = [r for r in after if r.tier == req.tier]
        key = self.policy.victim_key
        borrowed = self.memory.partition.borrowed(self.memory.pool.used_by_tier)
        return min(candidates, key=lambda r: key(r, borrowed), default=None)

    def _reclaim_for(self, req: Request, out: SchedulerOutput, now: float, fresh: set[Request]) -> Alloc:
        """Preempt running requests, as the policy allows, until `req` can be admitted."""
        memory, policy = self.memory, self.policy
        if not policy.preempts_for_admission(req, memory, memory.blocks_for(req.num_tokens)):
            return Alloc.NO_SPACE
        borrowed = memory.partition.borrowed(memory.pool.used_by_tier)
        candidates = [
            r for r in self.running if r not in fresh and policy.admission_victim_ok(req, r, memory)
        ]
        candidates.sort(key=lambda r: policy.victim_key(r, borrowed), reverse=True)
        status = Alloc.NO_SPACE
        while status is Alloc.NO_SPACE and candidates:
            victim = candidates.pop()
            self.running.remove(victim)
            self._preempt(victim, out, now)
            status = memory.admit(req)
        return status

    def _preempt(self, req: Request, out: SchedulerOutput, now: float) -> None:
        mode = self._preempt_mode(req)
        mapping = self.memory.swap_out(req) if mode is PreemptMode.SWAP else None
        req.num_preemptions += 1
        if mapping is not None:
            out.swap_out.extend(mapping)
            req.status = RequestStatus.SWAPPED
            self.swapped[req.tier].append(req)
            req.record(now, EventKind.PREEMPTED_SWAP, f"{len(mapping)} blocks")
        else:
            mode = PreemptMode.RECOMPUTE
            self.memory.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            req.record(now, EventKind.PREEMPTED_RECOMPUTE, f"{req.num_tokens} tokens to recompute")
        out.preempted.append((req, mode))

    def _preempt_mode(self, req: Request) -> PreemptMode:
        """Swap when moving the blocks over the host link costs less than `swap_factor`
        times prefilling them again (docs/design.md §4); otherwise recompute."""
        if not self.policy.allow_swap or req.num_computed_tokens == 0 or not req.block_ids:
            return PreemptMode.RECOMPUTE
        num_blocks = len(req.block_ids)
        if self.memory.host.num_free < num_blocks:
            return PreemptMode.RECOMPUTE
        swap_s = self.executor.estimate_swap_s(num_blocks)
        prefill_s = self.executor.estimate_prefill_s(req.num_computed_tokens)
        if swap_s < self.config.scheduler.swap_factor * prefill_s:
            return PreemptMode.SWAP
        return PreemptMode.RECOMPUTE
