"""The one owner of every request's state: which requests exist, which wait (in the
policy's queue), run or are swapped out, and every transition between those states —
admission, preemption, the return from swap, and the end of a request, written once.

The scheduler decides; the lifecycle applies. The engine asks it to submit, end and
update requests and never touches the lists itself.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from tierserve.clock import Clock
from tierserve.engine.stats import EngineStats
from tierserve.executors.base import StepBatch, StepResult
from tierserve.memory.manager import KVCacheManager
from tierserve.request import EventKind, FinishReason, Request, RequestStatus
from tierserve.scheduling.base import Policy
from tierserve.scheduling.errors import LifecycleError
from tierserve.scheduling.step import PreemptMode
from tierserve.tiers import Tier


@dataclass(slots=True)
class RequestOutput:
    request: Request
    new_token_ids: list[int]
    finished: bool


class Lifecycle:
    def __init__(self, policy: Policy, memory: KVCacheManager, clock: Clock, stats: EngineStats) -> None:
        self.policy = policy
        self.memory = memory
        self.clock = clock
        self.stats = stats
        self.requests: dict[str, Request] = {}  # every request not yet ended
        self.running: list[Request] = []  # see `Policy.running_pass` for its order
        self.swapped: list[Request] = []  # in `policy.running_key` order: who comes back first
        self.unsorted = False  # requests joined `running` since it was last put in policy order
        # Counts the changes to the running and swapped requests (admissions, preemptions,
        # returns, ends, a step's results): a kept leap (engine/leap.py) checks it.
        self.version = 0

    # ---- queries -------------------------------------------------------------------------

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def num_running(self, tier: Tier | None = None) -> int:
        return len(self.running) if tier is None else sum(1 for r in self.running if r.tier == tier)

    def num_swapped(self, tier: Tier | None = None) -> int:
        return len(self.swapped) if tier is None else sum(1 for r in self.swapped if r.tier == tier)

    # ---- transitions ---------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        self.requests[req.request_id] = req
        self.policy.add(req, self.clock.now())

    def admit(self, req: Request, now: float) -> None:
        """A waiting request the policy just popped starts running (its blocks are held)."""
        self.version += 1
        req.status = RequestStatus.RUNNING
        if req.admitted_time is None:
            req.admitted_time = now
            req.record(now, EventKind.ADMITTED, f"{req.num_cached_tokens} tokens cached")
        else:
            req.record(now, EventKind.READMITTED, f"{req.num_computed_tokens} tokens cached")
        self.running.append(req)
        self.unsorted = True

    def swapped_in(self, req: Request, num_blocks: int, now: float) -> None:
        self.version += 1
        self.swapped.remove(req)
        req.status = RequestStatus.RUNNING
        req.record(now, EventKind.SWAPPED_IN, f"{num_blocks} blocks")
        self.running.append(req)
        self.unsorted = True

    def preempt(
        self, req: Request, mode: PreemptMode, now: float
    ) -> tuple[PreemptMode, list[tuple[int, int]]]:
        """Take a running request out: by swap (its blocks go to the host pool) when `mode`
        says so and the host pool takes them, else by recompute. Returns the mode used and
        the (device, host) block pairs to copy. A request preempted by recompute waits
        outside the queue until `requeue`."""
        if req.status is not RequestStatus.RUNNING:
            raise LifecycleError(f"{req.request_id}: preempted while {req.status.value}")
        self.version += 1
        self.running.remove(req)
        mapping = self.memory.swap_out(req) if mode is PreemptMode.SWAP else None
        req.num_preemptions += 1
        if mapping is not None:
            req.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, req, key=self.policy.running_key)
            req.record(now, EventKind.PREEMPTED_SWAP, f"{len(mapping)} blocks")
            return PreemptMode.SWAP, mapping
        self.memory.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.record(now, EventKind.PREEMPTED_RECOMPUTE, f"{req.num_tokens} tokens to recompute")
        return PreemptMode.RECOMPUTE, []

    def requeue(self, req: Request, now: float) -> None:
        """A request preempted by recompute rejoins the waiting queue, ahead of its peers."""
        self.policy.prepend(req, now)

    def end(self, req: Request, reason: FinishReason, detail: str = "") -> None:
        """End a request in any state: the one place a request finishes, is aborted or shed."""
        if req.status.is_final:
            return
        self.version += 1
        if req.status is RequestStatus.WAITING:
            self.policy.remove(req)
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self.swapped.remove(req)
        self.memory.free(req)
        now = self.clock.now()
        req.finish_reason = reason
        req.finish_time = now
        if reason is FinishReason.ABORTED:
            req.status = RequestStatus.ABORTED
            req.record(now, EventKind.ABORTED)
            self.stats.num_aborted += 1
        elif reason is FinishReason.SHED:
            req.status = RequestStatus.SHED
            req.reject_reason = detail
            req.record(now, EventKind.SHED, detail)
            self.stats.num_shed[req.tier] += 1
        else:
            req.status = RequestStatus.FINISHED
            req.record(now, EventKind.FINISHED, reason.value)
            self.stats.num_finished += 1
        self.requests.pop(req.request_id, None)

    # ---- results of a step ---------------------------------------------------------------

    def apply(self, batch: StepBatch, result: StepResult, eos: tuple[int, ...]) -> list[RequestOutput]:
        """Record a step's computed tokens and samples; end the requests that finished."""
        self.version += 1
        now = self.clock.now()
        stats, memory = self.stats, self.memory
        block_size, caching_behind = memory.block_size, memory.caching_behind
        sampled_token_ids = result.sampled_token_ids
        outputs: list[RequestOutput] = []
        for seq in batch.prefills:
            stats.num_computed_prompt_tokens += seq.num_tokens
        num_sampled = 0
        for seqs in (batch.decodes, batch.prefills):
            for req, num_tokens in seqs:
                computed = req.num_computed_tokens + num_tokens
                req.num_computed_tokens = computed
                # Only a chunk that completes a block, or a request still behind, can have
                # full blocks for the prefix cache (`computed % block_size < num_tokens`:
                # a block boundary lies among the chunk's tokens).
                if computed % block_size < num_tokens or req.request_id in caching_behind:
                    memory.cache_computed_blocks(req)
                token_ids = req.token_ids
                if computed != len(token_ids):
                    continue  # the chunk did not reach the last token: nothing sampled
                token = sampled_token_ids[req.request_id]
                token_ids.append(token)
                num_sampled += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                    req.record(now, EventKind.FIRST_TOKEN)
                params = req.sampling
                reason: FinishReason | None = None
                if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
                    reason = FinishReason.STOP
                elif len(token_ids) - req.num_prompt_tokens >= params.max_tokens:
                    reason = FinishReason.LENGTH
                if reason is not None:
                    self.end(req, reason)
                outputs.append(RequestOutput(req, [token], reason is not None))
        stats.num_generated_tokens += num_sampled
        return outputs
