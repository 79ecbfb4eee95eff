"""One scheduling pass: which requests decode, which prefill chunks run, who is admitted,
who is preempted (and how), who comes back from swap.

Order within a pass: decodes of running requests (most protected first; when blocks run
out, victims come from the less protected ones), then swapped requests come back, then
prefill chunks of running requests, then new admissions in policy order. Every change
of state happens here, between steps; nothing leaves the batch while a step runs.
"""

from __future__ import annotations

import bisect
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
from tierserve.scheduling.base import Policy, RunningPass
from tierserve.scheduling.errors import PolicyOrderError
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
        self.swapped: list[Request] = []  # in policy.running_key order: who comes back first
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
        return len(self.swapped) if tier is None else sum(1 for r in self.swapped if r.tier == tier)

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
        prefilling: list[Request] = []
        if policy.running_pass is RunningPass.ADMISSION_ORDER:
            budget = self._walk_in_admission_order(out, decodes, prefills, budget, now)
            running = []  # walked already
        elif self._unsorted:
            running.sort(key=policy.running_key)
            self._unsorted = False
        # 1. Decodes, most protected first; a request that cannot grow takes blocks from
        #    the least protected requests after it, or yields its own.
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
        running = self.running
        just_preempted = {r for r, _ in out.preempted}
        for req in list(self.swapped):
            if len(running) >= cfg.max_num_seqs or req in just_preempted:
                break
            mapping = memory.swap_in(req)
            if mapping is Alloc.OVER_CEILING:
                continue  # its tier is full; others may still come back
            if isinstance(mapping, Alloc):
                break
            self.swapped.remove(req)
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
        admitting = policy.admits_after_preemption or not out.preempted
        while admitting and budget >= 1:
            head = policy.peek(now)
            if head is None:
                break
            req = head
            if any(policy.returns_first(s, req) for s in self.swapped):
                break
            if not policy.may_admit(req, memory):
                break
            if len(running) >= cfg.max_num_seqs and not self._free_seat_for(req, out, now, fresh):
                break
            status = memory.admit(req)
            if status is Alloc.NO_SPACE:
                status = self._reclaim_for(req, out, now, fresh)
                for victim, _ in out.preempted:
                    budget += decodes.pop(victim, 0) + prefills.pop(victim, 0)
            if status is not Alloc.OK:
                break
            popped = policy.pop(now)
            if popped is not req:
                raise PolicyOrderError(
                    f"{policy.name}: pop() returned {popped.request_id}, peek() {req.request_id}"
                )
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
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if req.tier != Tier.P0 and self.policy.shapes_steps:
            n = min(n, others_left)
        cap = self.policy.prefill_chunk_cap(req)
        return n if cap is None else min(n, cap)

    def _walk_in_admission_order(
        self,
        out: SchedulerOutput,
        decodes: dict[Request, int],
        prefills: dict[Request, int],
        budget: int,
        now: float,
    ) -> int:
        """vLLM V1's walk over the running list (RunningPass.ADMISSION_ORDER): each request in
        admission order gets its decode or prefill chunk; one short of blocks preempts the
        policy's first victim among all running requests, possibly itself, which ends the walk."""
        running, memory = self.running, self.memory
        borrowed = [0] * len(ALL_TIERS)
        i = 0
        while i < len(running) and budget >= 1:
            req = running[i]
            n = self._chunk(req, budget, budget)
            if n < 1:
                i += 1
                continue
            scheduled = True
            while memory.grow(req, req.num_computed_tokens + n) is not Alloc.OK:
                victim = min(running, key=lambda r: self.policy.victim_key(r, borrowed))
                victim_index = running.index(victim)
                running.pop(victim_index)
                given_back = decodes.pop(victim, 0) + prefills.pop(victim, 0)
                budget += given_back
                if victim_index < i:
                    i -= 1
                self._preempt(victim, out, now)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            is_decode = not req.is_prefilling
            (decodes if is_decode else prefills)[req] = n
            budget -= n
            i += 1
        return budget

    def _free_seat_for(self, req: Request, out: SchedulerOutput, now: float, fresh: set[Request]) -> bool:
        """All seats (max_num_seqs) are taken: preempt one victim for `req` if the policy allows."""
        policy, memory = self.policy, self.memory
        if not policy.preempts_for_seat(req):
            return False
        borrowed = memory.partition.borrowed(memory.pool.used_by_tier)
        candidates = [
            r for r in self.running if r not in fresh and policy.admission_victim_ok(req, r, memory)
        ]
        if not candidates:
            return False
        victim = min(candidates, key=lambda r: policy.victim_key(r, borrowed))
        self.running.remove(victim)
        self._preempt(victim, out, now)
        return True

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
        # Check before committing: preempt nobody unless the victims allowed free enough.
        if memory.num_free_blocks + sum(len(r.block_ids) for r in candidates) < memory.blocks_for(
            req.num_tokens
        ):
            return Alloc.NO_SPACE
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
            bisect.insort(self.swapped, req, key=self.policy.running_key)
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
        times prefilling them again (DESIGN.md §4); otherwise recompute."""
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
