"""The queue-policy interface every scheduling policy implements.

A policy owns the waiting queue (which request is admitted next) and answers the
questions the scheduler asks when memory runs out (who may be preempted, in what order).
Memory accounting always uses `Request.tier`, the tier the tenant is entitled to;
a policy may reorder the queue (aging) but never changes it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import TYPE_CHECKING, ClassVar

from tierserve.config import EngineConfig, PolicyOptions
from tierserve.request import Request
from tierserve.scheduling.errors import EmptyQueueError
from tierserve.tiers import ALL_TIERS, Tier

if TYPE_CHECKING:
    from tierserve.memory.manager import KVCacheManager
    from tierserve.scheduling.step import StepBudget, StepEstimate


class RunningPass(enum.Enum):
    """How the scheduler walks the running requests at the start of a pass."""

    # Decodes first, most protected (smallest `running_key`) first; a request short of
    # blocks takes them from less protected requests after it. Then swapped requests
    # come back, then prefill chunks.
    PROTECTED = "protected"
    # vLLM V1: one walk over the running list in admission order, decode or prefill chunk
    # alike; a request short of blocks preempts the first victim by `victim_key` among all
    # running requests (possibly itself, which ends the walk).
    ADMISSION_ORDER = "admission-order"


class Policy(ABC):
    name: ClassVar[str]
    tiered_memory: ClassVar[bool] = True  # apply floors, reserves and ceilings
    allow_swap: ClassVar[bool] = True  # preempt by swap where the cost rule says so
    running_pass: ClassVar[RunningPass] = RunningPass.PROTECTED
    admits_after_preemption: ClassVar[bool] = True  # False: a pass that preempted admits nothing
    options_type: ClassVar[type[PolicyOptions] | None] = None  # its [policy.NAME] settings
    # Whether admission may pass a head that waits for its own tier's memory (its ceiling):
    # `hold_tier` sets its tier aside for the rest of the pass. False: admission stops at
    # such a head, and every tier behind it waits too (vLLM's admission does the same).
    holds_tiers: ClassVar[bool] = False

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._num_waiting = [0] * len(ALL_TIERS)
        self.keeps_undo = False

    # ---- the waiting queue ---------------------------------------------------------------

    def add(self, req: Request, now: float) -> None:
        """Enqueue a newly arrived request."""
        self._num_waiting[req.tier] += 1
        self._push(req, now)

    def prepend(self, req: Request, now: float) -> None:
        """Put back a request that was preempted by recompute, ahead of its peers."""
        self._num_waiting[req.tier] += 1
        self._push_front(req, now)

    def keep_undo(self, on: bool = True) -> None:
        """Keep, from now on, what `put_back` needs to undo a pop exactly, until
        `forget_undo` (the vLLM plug-in, whose engine puts back the requests it skips in a
        pass). Off (tierserve's own engine, which never puts one back), a pop keeps nothing."""
        self.keeps_undo = on

    def forget_undo(self) -> None:
        """The pops so far will not be put back (a pass is over): their records go."""
        return None  # a policy whose pops keep nothing (fcfs, the priority heaps)

    def put_back(self, req: Request, now: float) -> None:
        """Return a request popped a moment ago that the engine did not run (vLLM skips a
        waiting request whose grammar is not compiled, whose LoRA has no slot, or whose KV
        connector cannot yet say what it holds): it waits again as if it had not been
        popped, and whatever popping it charged its tier or tenant is given back."""
        self._num_waiting[req.tier] += 1
        self._put_back(req, now)

    @abstractmethod
    def peek(self, now: float) -> Request | None:
        """The request `pop` would return now; aging is evaluated here, on every pass."""

    @contextmanager
    def looking_ahead(self, now: float) -> Iterator[Iterator[Request]]:
        """Inside, the waiting requests in the order `pop` gives them now, popped one by one
        as they are read; on leaving, those read are put back (`put_back`, last first), and
        the queue, its tiers and its tenants are as they were (a pass asking which requests
        its admission would take, beyond the head). Exact for up to SERVES_KEPT pops (the
        fair queues' undo records), with those of the pass already kept: read fewer."""
        kept = self.keeps_undo
        if not kept:  # turned on, the fair queues' undo records start afresh
            self.keep_undo(True)
        popped: list[Request] = []

        def read() -> Iterator[Request]:
            while len(self):
                try:
                    popped.append(self.pop(now))
                except EmptyQueueError:  # the rest are of tiers set aside (`hold_tier`)
                    return
                yield popped[-1]

        try:
            yield read()
        finally:
            for req in reversed(popped):
                self.put_back(req, now)
            if not kept:  # records of the pass's own pops, where it keeps them, stay
                self.forget_undo()
                self.keep_undo(False)

    def pop(self, now: float) -> Request:
        req = self._pop(now)
        self._num_waiting[req.tier] -= 1
        return req

    def remove(self, req: Request) -> None:
        """Take a waiting request out of the queue (abort)."""
        self._remove(req)
        self._num_waiting[req.tier] -= 1

    def num_waiting(self, tier: Tier | None = None) -> int:
        return sum(self._num_waiting) if tier is None else self._num_waiting[tier]

    def waiting_by_tier(self) -> tuple[int, ...]:
        """`num_waiting(t)` for each tier, P0 first."""
        return tuple(self._num_waiting)

    def __len__(self) -> int:
        return sum(self._num_waiting)

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Every waiting request (any order)."""

    @abstractmethod
    def _push(self, req: Request, now: float) -> None: ...

    @abstractmethod
    def _push_front(self, req: Request, now: float) -> None: ...

    @abstractmethod
    def _pop(self, now: float) -> Request: ...

    def _put_back(self, req: Request, now: float) -> None:
        # A policy that charges nothing for a pop: the head of its tier is where it was.
        self._push_front(req, now)

    @abstractmethod
    def _remove(self, req: Request) -> None: ...

    # ---- running requests and preemption -------------------------------------------------

    def running_key(self, req: Request) -> tuple[float, ...]:
        """Running requests are protected in this order: the smallest key is kept longest.

        When a running request needs a block and none is free, the victim is chosen by
        `victim_key` among the requests ordered after it, or else it yields itself.
        """
        return (req.tier, req.arrival_time)

    def preempts_for_admission(self, req: Request, memory: KVCacheManager, num_blocks: int) -> bool:
        """Whether a waiting request may preempt running ones to be admitted."""
        return False

    def admission_victim_ok(self, req: Request, victim: Request, memory: KVCacheManager) -> bool:
        """Whether a waiting request admitted by preemption may take `victim`'s blocks."""
        return victim.tier > req.tier

    def victim_key(self, victim: Request, borrowed: Sequence[int]) -> tuple[float, ...]:
        """Victims are taken smallest key first: lowest tier, borrowers, least work lost.

        `borrowed` is the blocks each tier holds beyond its share (`TierPartition.borrowed`).
        """
        return (-victim.tier, 0 if borrowed[victim.tier] else 1, victim.num_computed_tokens)

    def may_admit(self, req: Request, memory: KVCacheManager) -> bool:
        """A last word before admission (best-effort tiers wait for idle capacity)."""
        return True

    def preempts_for_seat(self, req: Request) -> bool:
        """Whether a waiting request may preempt a running one when `max_num_seqs` are
        running (victims: `seat_victim_ok`, in `victim_key` order)."""
        return False

    def seat_victim_ok(self, req: Request, victim: Request, memory: KVCacheManager) -> bool:
        """Whether a waiting request may take `victim`'s seat (as it may take its blocks)."""
        return self.admission_victim_ok(req, victim, memory)

    def returns_first(self, swapped: Request, head: Request) -> bool:
        """Whether a swapped request must come back before `head` is admitted."""
        return swapped.tier <= head.tier

    def may_swap_in(self, swapped: Request) -> bool:
        """Whether a swapped-out request may come back now (seats and memory permitting)."""
        return True

    def hold_tier(self, tier: Tier) -> None:
        """For the rest of this pass, leave `tier` out of `peek` and `pop`: its head waits
        for memory only its own tier's running requests can free (where `holds_tiers`)."""
        raise NotImplementedError(f"{self.name} does not hold tiers")

    def release_held(self) -> None:
        """End the holds of `hold_tier` outside a step (the gateway's queue has no steps)."""
        raise NotImplementedError(f"{self.name} does not hold tiers")

    # ---- shaping the step (hooks every policy may use; the defaults do nothing) -----------

    def to_shed(self, now: float) -> list[tuple[Request, str]]:
        """Waiting requests to drop now, each with the reason recorded on it (overload)."""
        return []

    def begin_step(
        self,
        step: StepBudget,
        running: Sequence[Request],
        now: float,
        prefilling: Sequence[Request] | None = None,
        first_chunk: Callable[[Request], int | None] | None = None,
    ) -> None:
        """Called before a pass fills `step`; may cap some tiers' prefill (`step.cap_prefill`).
        `prefilling`: the running requests still prefilling, where the caller knows them
        (None: `request.prefilling(running)`). `first_chunk(req)`, where the caller gives
        it: the prompt tokens waiting `req` would prefill on coming in (less its cached
        prefix), or None where it could not come in in this pass as seats and memory stand."""
        return None

    def end_step(self, step: StepBudget, now: float) -> None:
        """Called once the pass has filled `step`; may leave work out of it (`step.drop_where`)."""
        return None

    def solo_tier(self, tiers_prefilling: AbstractSet[Tier]) -> Tier | None:
        """For a step built outside tierserve's engine (the vLLM plug-in), called once per
        step with the tiers that will prefill in it: the one tier whose work alone the step
        should carry, or None for a mixed step. The call counts the step in the policy's
        history, so a policy can bound how often the other tiers sit out."""
        return None

    def prefill_cap(
        self, decode_tokens: int, p0_prefilling: bool, now: float, estimate_s: StepEstimate | None
    ) -> int | None:
        """For a step built outside tierserve's engine (the vLLM plug-in): the prompt tokens
        the tiers below P0 may have in it beside `decode_tokens` tokens of decodes, with
        `estimate_s(num_tokens, context)` the step time predicted (None: unknown), or None
        for no cap."""
        return None

    # ---- fast simulation --------------------------------------------------------------

    # Whether the fast simulation may leap over steps in which every running request
    # decodes and nothing waits or is swapped out: true where the pass's hooks, for such a
    # step, change nothing but what `steady_step` records.
    leaps_decodes: ClassVar[bool] = False
    # Whether it may also leap while requests wait or are swapped out, each step's pass
    # checked by `Scheduler.decodes_only` against the memory as the step's decodes would
    # leave it: true where `to_shed` only asks, `begin_step`'s effects are redone by every
    # pass, `peek` asked twice at one time changes nothing the first did not, and
    # `may_admit` and `preempts_for_admission` (asked before the decodes take their
    # blocks) never turn from False to True as blocks are taken.
    leaps_while_waiting: ClassVar[bool] = False

    def steady_step(self) -> None:
        """Record a leapt step (all decodes, nothing waiting) as its pass's hooks would have."""
        return None

    def prefers_swap(self, swap_s: float, prefill_s: float) -> bool:
        """Preempt by swap (else recompute), given the one-way swap time of the victim's
        blocks and the time to prefill them again: the article's rule, `swap_factor`."""
        return swap_s < self.config.scheduler.swap_factor * prefill_s

    def prefill_chunk_cap(self, req: Request) -> int | None:
        """The most prompt tokens `req` may prefill in one step (None: no cap beyond the
        step's budget). By default a long P1-or-lower prompt is chunked smaller."""
        cfg = self.config.scheduler
        if req.tier != Tier.P0 and req.num_prompt_tokens > cfg.long_prompt_tokens:
            return cfg.long_prompt_chunk_tokens
        return None
