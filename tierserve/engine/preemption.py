"""Preemption: choosing victims as the policy orders them, and taking each out by swap
or recompute, whichever the cost rule picks for it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from tierserve.config import EngineConfig
from tierserve.engine.lifecycle import Lifecycle
from tierserve.executors.base import Executor
from tierserve.memory.manager import Alloc, KVCacheManager
from tierserve.request import Request
from tierserve.scheduling.base import Policy
from tierserve.scheduling.step import PreemptMode, StepBudget
from tierserve.tiers import ALL_TIERS

NO_BLOCKS = (0,) * len(ALL_TIERS)  # `KVCacheManager.admit_status_after`: no blocks taken first


class Preemptor:
    def __init__(
        self,
        config: EngineConfig,
        policy: Policy,
        memory: KVCacheManager,
        executor: Executor,
        lifecycle: Lifecycle,
    ) -> None:
        self.config = config
        self.policy = policy
        self.memory = memory
        self.executor = executor
        self.lifecycle = lifecycle
        # Called before a victim is chosen among the running requests (fast simulation:
        # writes out the requests it keeps in aggregate, whose counts the choice reads).
        self.before_choosing: Callable[[], None] | None = None

    def _borrowed(self) -> Sequence[int]:
        return self.memory.partition.borrowed(self.memory.pool.used_by_tier)

    def preempt(self, req: Request, step: StepBudget, now: float) -> None:
        """Take `req` out of the running set and out of this step's work."""
        step.give_back(req)
        mode, mapping = self.lifecycle.preempt(req, self.mode_for(req), now)
        step.swap_out.extend(mapping)
        step.preempted.append((req, mode))

    def mode_for(self, req: Request) -> PreemptMode:
        """Swap or recompute, by the policy's cost rule over the executor's estimates."""
        if not self.policy.allow_swap or req.num_computed_tokens == 0 or not req.block_ids:
            return PreemptMode.RECOMPUTE
        num_blocks = len(req.block_ids)
        if self.memory.host.num_free < num_blocks:
            return PreemptMode.RECOMPUTE
        swap_s = self.executor.estimate_swap_s(num_blocks)
        prefill_s = self.executor.estimate_prefill_s(req.num_computed_tokens)
        return PreemptMode.SWAP if self.policy.prefers_swap(swap_s, prefill_s) else PreemptMode.RECOMPUTE

    def _choosing(self) -> None:
        if self.before_choosing is not None:
            self.before_choosing()

    def decode_victim(self, req: Request, after: list[Request], *, same_tier: bool) -> Request | None:
        self._choosing()
        candidates: Iterable[Request] = after
        if same_tier:
            candidates = [r for r in after if r.tier == req.tier]
        key, borrowed = self.policy.victim_key, self._borrowed()
        return min(candidates, key=lambda r: key(r, borrowed), default=None)

    def any_victim(self, running: list[Request]) -> Request:
        """The policy's first victim among all running requests (vLLM's rule)."""
        self._choosing()
        key, borrowed = self.policy.victim_key, self._borrowed()
        return min(running, key=lambda r: key(r, borrowed))

    def _admission_candidates(
        self, req: Request, step: StepBudget, ok: Callable[[Request, Request, KVCacheManager], bool]
    ) -> list[Request]:
        """The running requests `ok` lets `req` take, first victim first."""
        self._choosing()
        memory, victim_key = self.memory, self.policy.victim_key
        borrowed = self._borrowed()
        candidates = [r for r in self.lifecycle.running if r not in step.fresh and ok(req, r, memory)]
        candidates.sort(key=lambda r: victim_key(r, borrowed))
        return candidates

    def victims_before(
        self,
        req: Request,
        swapped: Request,
        step: StepBudget,
        ok: Callable[[Request, Request, KVCacheManager], bool],
    ) -> list[Request]:
        """The running requests `ok` lets `req` take that come before `swapped`, were it
        running, in the policy's victim order."""
        candidates = self._admission_candidates(req, step, ok)
        key, borrowed = self.policy.victim_key, self._borrowed()
        last = key(swapped, borrowed)
        return [c for c in candidates if key(c, borrowed) < last]

    def free_seat_for(self, req: Request, step: StepBudget, now: float) -> bool:
        """Every seat (max_num_seqs) is taken: preempt one victim for `req` if the policy allows."""
        victims = self._victims_to_admit(req, step, seat_needed=True)
        if not victims or not self._seat_pays(req, victims):
            return False
        self.preempt(victims[0], step, now)
        return True

    def _seat_pays(self, req: Request, victims: list[Request]) -> bool:
        """Whether taking the seat of `victims[0]` lets `req` in: it could then get its
        blocks, from the free ones, the seat's victim's and those `reclaim_for` may take
        (else the victim went for nothing, and waited behind `req` until a seat came free),
        and the seat's victim alone does not leave its tier over its ceiling, where
        admission sets the tier aside rather than reclaim (`Scheduler._admit`: a P3 request
        was recomputed every other pass for a P0 prompt over P0's ceiling, a review found)."""
        seat_alone = self._status_after(req, victims[:1])
        return seat_alone is not Alloc.OVER_CEILING and self.fits_after(req, victims)

    def could_admit(self, req: Request, step: StepBudget) -> bool:
        """Whether `req` could come in in this pass as seats and memory stand, preempting
        nobody: a seat, free or one `free_seat_for` may take, and its blocks, free or
        those `reclaim_for` may take (their checks, without their effects)."""
        seat_needed = len(self.lifecycle.running) >= step.seats
        if not seat_needed:
            status = self.memory.admit_status_after(req, NO_BLOCKS)
            if status is Alloc.OK:
                return True  # no victim to choose: the fast simulation's kept decoders stay kept
            if status is Alloc.OVER_CEILING:
                # Admission reclaims for a request that finds no space, not for one whose
                # tier holds all it may (`Scheduler._admit`): a P0 prompt over its ceiling,
                # blocks charged to P0 held by a P1 prompt, read as one that could come in.
                return False
        victims = self._victims_to_admit(req, step, seat_needed=seat_needed)
        if victims is None:  # it needs a seat and may take none
            return False
        if seat_needed:
            return bool(victims) and self._seat_pays(req, victims)
        return self.fits_after(req, victims)

    def _victims_to_admit(self, req: Request, step: StepBudget, *, seat_needed: bool) -> list[Request] | None:
        """The running requests `req` may take to come in: a seat's victim first where it
        needs a seat, then those `reclaim_for` may take. None: it needs a seat and may take
        none."""
        policy, memory = self.policy, self.memory
        victims: list[Request] = []
        if seat_needed:
            if not policy.preempts_for_seat(req):
                return None
            seat = self._admission_candidates(req, step, policy.seat_victim_ok)
            if not seat:
                return None
            victims.append(seat[0])
        if policy.preempts_for_admission(req, memory, memory.blocks_to_admit(req, {})):
            victims += self._admission_candidates(req, step, policy.admission_victim_ok)
        return victims

    def fits_after(self, req: Request, victims: list[Request], taken: Sequence[int] = NO_BLOCKS) -> bool:
        return self._status_after(req, victims, taken) is Alloc.OK

    def _status_after(self, req: Request, victims: list[Request], taken: Sequence[int] = NO_BLOCKS) -> Alloc:
        """How `req`'s blocks would fare in the memory check (its tier's ceiling, the
        unfilled floors of more urgent tiers) once all of `victims` had freed theirs (and
        `taken[t]` more blocks had gone to each tier t, to others coming in first): those
        no one else holds (a prefix two victims share is one block; one a request outside
        them holds stays). Counting free blocks alone, a victim went for a request that a
        floor or its ceiling still kept out. Its prefix hits on blocks someone else keeps
        cost it nothing (charged its whole length, a P0 behind a shared system prompt was
        kept over its ceiling and waited for the prompt's holder to end)."""
        holders = Counter(b for r in dict.fromkeys(victims) for b in r.block_ids)
        pool = self.memory.pool
        freed = [0] * len(ALL_TIERS)
        for b, n in holders.items():
            if pool.ref_count[b] == n:
                freed[pool.charged_tier[b]] += 1
        needed = self.memory.blocks_to_admit(req, holders)
        net = [n - f for n, f in zip(taken, freed, strict=True)]
        return self.memory.check_after(req.tier, needed, net)

    def reclaim_for(self, req: Request, step: StepBudget, now: float) -> Alloc:
        """Preempt running requests, as the policy allows, until `req` can be admitted.
        Nobody is preempted unless the victims allowed could free enough blocks."""
        memory = self.memory
        # What admission would charge: a prefix someone holds is free (charged its whole
        # length, a P1 behind a shared prompt was kept from reclaiming its own entitlement).
        if not self.policy.preempts_for_admission(req, memory, memory.blocks_to_admit(req, {})):
            return Alloc.NO_SPACE
        candidates = self._admission_candidates(req, step, self.policy.admission_victim_ok)
        if not self.fits_after(req, candidates):
            return Alloc.NO_SPACE
        status = Alloc.NO_SPACE
        for victim in candidates:
            self.preempt(victim, step, now)
            status = memory.admit(req)
            if status is not Alloc.NO_SPACE:
                break
        return status
