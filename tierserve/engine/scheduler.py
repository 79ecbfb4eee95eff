"""One scheduling pass, in phases around a `StepBudget`: which requests decode, which
prefill chunks run, who is admitted, who is preempted (and how), who comes back from swap.

    begin (policy hook: shed, cap some tiers' prefill)
    -> running requests (policy's `running_pass`: protected order, or vLLM's walk)
    -> swapped requests come back
    -> prefill chunks of running requests
    -> admissions in policy order (with seat and memory reclaim where the policy allows)
    -> end (policy hook: take work out of the step) -> victims rejoin the queue

Every change of state happens here, between steps, through the `Lifecycle`; nothing
leaves the batch while a step runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.engine.lifecycle import Lifecycle
from tierserve.engine.preemption import Preemptor
from tierserve.executors.base import Executor, ScheduledSeq, StepBatch, decode_seqs
from tierserve.memory.manager import Alloc, KVCacheManager
from tierserve.request import FinishReason, Request, RequestStatus
from tierserve.scheduling.base import Policy, RunningPass
from tierserve.scheduling.errors import PolicyOrderError
from tierserve.scheduling.step import PreemptMode, StepBudget
from tierserve.tiers import ALL_TIERS

# Waiting requests a pass reads ahead of its swap-ins (`_admitted_ahead`). More than a pass
# admits while it has swapped requests to bring back, and a small share of what a policy's
# undo records hold (SERVES_KEPT, 256): read at every seat, up to 512, the pops past those
# records were put back inexactly, and with 20,000 waiting a pass took 75-550 ms, not 3.
LOOK_AHEAD_MAX = 64


@dataclass
class SchedulerOutput:
    batch: StepBatch
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    preempted: list[tuple[Request, PreemptMode]] = field(default_factory=list)
    shed: list[Request] = field(default_factory=list)


class Ahead(NamedTuple):
    """A waiting request a pass would admit, and the blocks per tier taken before it."""

    request: Request
    taken: tuple[int, ...]


class KeptDecodes(Protocol):
    """Fast simulation (engine/leap.py): running requests whose decodes are kept in
    aggregate, their token counts brought up to date only when read one by one."""

    def prefilling(self) -> list[Request]:
        """The running requests that still prefill, in protection order."""
        ...

    def decode(self, step: StepBudget) -> None:
        """`_decode_protected` for a pass in which every kept request decodes and every
        block they need is known to be free: take the blocks, add the decodes."""
        ...

    def walk(self, step: StepBudget) -> bool:
        """`_walk_in_admission_order` with the kept requests' decodes in aggregate; False,
        with nothing changed, where the walk would have to preempt."""
        ...

    def flush(self) -> None:
        """Bring every kept request up to date and stop keeping them."""
        ...


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        policy: Policy,
        memory: KVCacheManager,
        executor: Executor,
        clock: Clock,
        lifecycle: Lifecycle,
    ) -> None:
        self.config = config
        self.policy = policy
        self.memory = memory
        self.clock = clock
        self.lifecycle = lifecycle
        self.executor = executor
        self.preemptor = Preemptor(config, policy, memory, executor, lifecycle)
        self._forced: list[Request] = []  # victims named from outside, taken at the next pass
        # Whether a waiting request may ever take a running one's seat or blocks: where not
        # (fcfs, wfq, drr), a swapped request never stays out for one (`_yields_to`), and
        # the pass need not read ahead in the queue.
        self._looks_ahead = any(
            getattr(type(policy), name) is not getattr(Policy, name)
            for name in ("preempts_for_seat", "preempts_for_admission")
        )

    def request_preemption(self, req: Request) -> None:
        """Preempt a running request at the next step boundary."""
        self._forced.append(req)

    def has_forced(self) -> bool:
        """Whether the next pass has preemptions asked for from outside."""
        return bool(self._forced)

    # ---- the pass ------------------------------------------------------------------------

    def schedule(self, kept: KeptDecodes | None = None) -> SchedulerOutput:
        """The pass. `kept` (fast simulation): the running requests that decode in this
        pass, kept in aggregate; before choosing a victim among the running requests, the
        pass has them written out."""
        now = self.clock.now()
        cfg = self.config.scheduler
        step = StepBudget(
            cfg.max_num_batched_tokens, cfg.max_num_seqs, estimate_s=self.executor.estimate_prefill_s
        )
        if kept is None:
            shed = self._begin(step, now)
            if self.policy.running_pass is RunningPass.ADMISSION_ORDER:
                self._walk_in_admission_order(step, now)
                prefilling: list[Request] = []
            else:
                prefilling = self._decode_protected(step, now)
            return self._finish(step, prefilling, shed, now)
        self.preemptor.before_choosing = kept.flush
        try:
            prefilling = kept.prefilling()
            shed = self._begin(step, now, prefilling)
            if self.policy.running_pass is RunningPass.PROTECTED:
                kept.decode(step)
            else:
                if not kept.walk(step):
                    kept.flush()
                    self._walk_in_admission_order(step, now)
                prefilling = []
            return self._finish(step, prefilling, shed, now)
        finally:
            self.preemptor.before_choosing = None

    def _finish(
        self, step: StepBudget, prefilling: list[Request], shed: list[Request], now: float
    ) -> SchedulerOutput:
        """The pass after the running requests' decodes: swaps in, prompts, admissions."""
        self._swap_in(step, prefilling, now)
        self._prefill_running(step, prefilling)
        if self.policy.admits_after_preemption or not step.preempted:
            self._admit(step, now)
        self.policy.end_step(step, now)
        # Victims preempted by recompute rejoin the queue only now, so that the policy's
        # order cannot shift between its peek and pop, nor re-admit them in this pass.
        for victim, mode in step.preempted:
            if mode is PreemptMode.RECOMPUTE:
                self.lifecycle.requeue(victim, now)
        batch = StepBatch(decode_seqs(step.decodes), [ScheduledSeq(r, n) for r, n in step.prefills.items()])
        return SchedulerOutput(batch, step.swap_out, step.swap_in, step.preempted, shed)

    def _begin(self, step: StepBudget, now: float, prefilling: list[Request] | None = None) -> list[Request]:
        for req in self._forced:
            if req.status is RequestStatus.RUNNING:
                self.preemptor.preempt(req, step, now)
        self._forced.clear()
        shed = []
        for req, reason in self.policy.to_shed(now):
            self.lifecycle.end(req, FinishReason.SHED, reason)
            shed.append(req)
        self.policy.begin_step(step, self.lifecycle.running, now, prefilling, self._first_chunk_for(step))
        return shed

    def _first_chunk_for(self, step: StepBudget) -> Callable[[Request], int | None]:
        """`Policy.begin_step`'s `first_chunk`: for a policy that keeps step tokens for a
        waiting request, the prompt tokens it would prefill on coming in, or None where it
        could not come in in this pass (nothing swapped returns first, its tier admits it,
        a seat and blocks, free or those it may take)."""

        asked: dict[Request, tuple[int, int | None]] = {}  # by the running and swapped sets' version

        def first_chunk(req: Request) -> int | None:
            version = self.lifecycle.version
            known = asked.get(req)
            if known is not None and known[0] == version:
                return known[1]
            answer = ask(req)
            asked[req] = (version, answer)
            return answer

        def ask(req: Request) -> int | None:
            policy, memory = self.policy, self.memory
            if any(policy.returns_first(s, req) for s in self.lifecycle.swapped):
                return None
            if not policy.may_admit(req, memory) or not self.preemptor.could_admit(req, step):
                return None
            return req.num_tokens - memory.cached_prefix_tokens(req)

        return first_chunk

    def _decode_protected(self, step: StepBudget, now: float) -> list[Request]:
        """Decodes, most protected first (RunningPass.PROTECTED); a request that cannot grow
        takes blocks from the least protected requests after it, or yields its own.
        Returns the running requests that still prefill, in protection order."""
        life, memory = self.lifecycle, self.memory
        running, block_size = life.running, memory.block_size
        if life.unsorted:
            running.sort(key=self.policy.running_key)
            life.unsorted = False
        prefilling: list[Request] = []
        decodes = step.decodes
        i = 0
        while i < len(running):
            req = running[i]
            num_tokens = len(req.token_ids)
            # `req.is_prefilling` and, below, `step.add_decode(req)`, inlined: this loop
            # visits every running request in every pass.
            if req.num_computed_tokens < num_tokens - 1 or num_tokens == req.num_prompt_tokens:
                prefilling.append(req)
            elif step.tokens_left >= 1:
                # Most decodes need no new block: `grow`'s first check, without the call.
                covered = len(req.block_ids) * block_size >= num_tokens
                status = Alloc.OK if covered else memory.grow(req, num_tokens)
                while status is not Alloc.OK:
                    same_tier = status is Alloc.OVER_CEILING
                    victim = self.preemptor.decode_victim(req, running[i + 1 :], same_tier=same_tier)
                    if victim is None:
                        break
                    self.preemptor.preempt(victim, step, now)
                    status = memory.grow(req, req.num_tokens)
                if status is not Alloc.OK:
                    self.preemptor.preempt(req, step, now)
                    continue  # `running[i]` is now the next request
                decodes[req] = 1
                step.tokens_left -= 1
            i += 1
        return prefilling

    def _walk_in_admission_order(self, step: StepBudget, now: float) -> None:
        """vLLM V1's walk (RunningPass.ADMISSION_ORDER): each running request in admission
        order gets its decode or prefill chunk; one short of blocks preempts the policy's
        first victim among all running requests, possibly itself, which ends the walk."""
        running, memory = self.lifecycle.running, self.memory
        i = 0
        while i < len(running) and step.tokens_left >= 1:
            req = running[i]
            n = step.chunk_for(req, self.policy.prefill_chunk_cap(req))
            if n < 1:
                i += 1
                continue
            while memory.grow(req, req.num_computed_tokens + n) is not Alloc.OK:
                victim = self.preemptor.any_victim(running)
                if running.index(victim) < i:
                    i -= 1
                self.preemptor.preempt(victim, step, now)
                if victim is req:
                    return
            if req.is_prefilling:
                step.add_prefill(req, n)
            else:
                step.add_decode(req)
            i += 1

    def _swap_in(self, step: StepBudget, prefilling: list[Request], now: float) -> None:
        """Swapped requests come back, in `running_key` order, before new admissions, but
        not into room that the more urgent waiting requests this pass admits can take now
        (`_yields_to`)."""
        life, memory, policy = self.lifecycle, self.memory, self.policy
        just_preempted = {r for r, _ in step.preempted}
        head: Request | None = None
        ahead: list[Ahead] | None = None  # whom admission takes, as memory and seats stand
        cut = False  # the look stopped at a request a swapped one returns before
        held = False  # one stayed out for them: the rest may not take their room
        for req in list(life.swapped):
            if len(life.running) >= step.seats or req in just_preempted:
                break
            if not policy.may_swap_in(req):
                continue  # held out by its policy; others may still come back
            status = memory.check(req.tier, len(req.host_block_ids))
            if status is Alloc.OVER_CEILING and policy.tiered_memory:
                # Its tier is full: only its own running requests can make room, and others
                # may still come back. (In one pool for every tier, a ceiling of the whole
                # pool is no tier's own: fcfs had brought a newer request back past it.)
                continue
            if status is not Alloc.OK:
                break
            head = head or policy.peek(now)  # the queue does not change in this loop
            crowded: int | None = None
            if head is not None and self._looks_ahead and not policy.returns_first(req, head):
                if ahead is None:
                    ahead, cut = self._admitted_ahead(step, prefilling, now)
                crowded = self._first_crowded(req, ahead, step)
                if held:
                    if crowded is not None or self._takes_prompt_room(req, head, step, prefilling):
                        continue
                elif crowded is not None and self._yields_to(req, ahead, crowded, step):
                    held = True
                    continue
            elif ahead:  # it comes back before the head: whose room it takes all the same
                crowded = self._first_crowded(req, ahead, step)
            mapping = memory.swap_in(req)
            if isinstance(mapping, Alloc):
                break
            life.swapped_in(req, len(mapping), now)
            step.swap_in.extend(mapping)
            step.fresh.add(req)
            if req.is_prefilling:
                prefilling.append(req)
            elif step.tokens_left >= 1 and memory.grow(req, req.num_tokens) is Alloc.OK:
                step.add_decode(req)
            if ahead is not None:  # it took a seat, blocks and perhaps tokens: fewer fit
                ahead = None if cut else self._still_admitted(ahead[:crowded], step, prefilling)

    def _admitted_ahead(
        self, step: StepBudget, prefilling: list[Request], now: float
    ) -> tuple[list[Ahead], bool]:
        """The waiting requests `_admit` would take in this pass, in its order, were no
        swapped request to come back, each with the blocks per tier that those before it
        take: each finds a seat, a step token after the running prompts' chunks and those
        before it (at most each prompt's rest, within the policy's chunk cap and the step's
        cap on its tier) and room for its blocks, up to the first that does not, or that a
        swapped request comes back before (then the second value is True), and at most
        LOOK_AHEAD_MAX. A request over its tier's ceiling sets its tier aside where the
        policy `holds_tiers`, as `_admit` does, and the look goes on behind it. Read off the
        queue by popping and putting back (`Policy.looking_ahead`), so the order is the
        policy's own however it is kept."""
        policy, memory, life = self.policy, self.memory, self.lifecycle
        if step.preempted and not policy.admits_after_preemption:
            return [], False
        ahead: list[Ahead] = []
        taken = [0] * len(ALL_TIERS)
        room = _PromptRoom(step, policy.prefill_chunk_cap, prefilling)
        most = min(step.seats - len(life.running), LOOK_AHEAD_MAX)
        cut = held = False
        with policy.looking_ahead(now) as waiting:
            for req in waiting:
                if len(ahead) >= most or not step.has_prefill_room(req.tier):
                    break
                if any(policy.returns_first(s, req) for s in life.swapped):
                    cut = True
                    break
                if not policy.may_admit(req, memory) or not room.fits(req):
                    break
                status = memory.admit_status_after(req, taken)
                if status is Alloc.OVER_CEILING and policy.holds_tiers:
                    policy.hold_tier(req.tier)
                    held = True
                    continue
                if status is not Alloc.OK:
                    break
                ahead.append(Ahead(req, tuple(taken)))
                taken[req.tier] += memory.blocks_to_admit(req, {}, taken)
                room.add(req)
        if held:
            policy.release_held()  # `_admit` holds its own; nothing was held before it
        return ahead, cut

    def _still_admitted(self, ahead: list[Ahead], step: StepBudget, prefilling: list[Request]) -> list[Ahead]:
        """`ahead` once a swapped request has come back, cut where it crowded the first
        (`_first_crowded`, which asked each one's blocks with it back): its requests up to
        the first that no longer finds a seat or a step token. A swap-in only takes room, so
        the look's other answers stand (where it stopped at a request the swapped one
        returned before, the caller looks again)."""
        seats = step.seats - len(self.lifecycle.running)
        room = _PromptRoom(step, self.policy.prefill_chunk_cap, prefilling)
        for j, (req, _) in enumerate(ahead):
            if j >= seats or not step.has_prefill_room(req.tier) or not room.fits(req):
                return ahead[:j]
            room.add(req)
        return ahead

    def _first_crowded(self, req: Request, ahead: list[Ahead], step: StepBudget) -> int | None:
        """The index in `ahead` of the first request that swapped-out `req` coming back
        would leave without a seat or without room for its blocks, those before it in."""
        seats = step.seats - len(self.lifecycle.running) - 1
        back = self._blocks_back(req, step)
        for j, (waiting, taken) in enumerate(ahead):
            if j >= seats:
                return j
            with_req = list(taken)
            with_req[req.tier] += back
            if self.memory.admit_status_after(waiting, with_req) is not Alloc.OK:
                return j
        return None

    def _yields_to(self, req: Request, ahead: list[Ahead], j: int, step: StepBudget) -> bool:
        """Whether swapped-out `req` stays out this pass for `ahead[j]`, a more urgent waiting
        request this pass admits were `req` to stay out, whose seat or blocks `req` coming
        back would take (`_first_crowded`): whether it may take them from `req`, were `req`
        running (its victim rules, read with `req`'s blocks counted). Swapped in, `req` is
        no victim in this pass (it is fresh), so the waiting request waited, and at the
        next pass preempted `req`: a swap each way for nothing, the waiting request a step
        late and counted as waiting for memory a lower tier held. Judged by the queue's
        head alone (until 2026-12-07), `req` came back into the room of the requests behind
        it. Where the requests it would take before `req` (the victim order) make its room
        on their own with `req` back, or it may not take `req`'s place, `req` comes back, as
        a running request keeps its place."""
        policy, memory = self.policy, self.memory
        waiting, taken = ahead[j]
        # The victim rules read the tiers' use with `req` running and the blocks of the
        # requests admitted before `waiting` taken: a P0 ahead of it could make `req`'s tier
        # a borrower, which only then may lose its place to `waiting`.
        with memory.as_if_back(req), memory.as_if_taken(taken):
            if len(self.lifecycle.running) + 1 + j >= step.seats:
                ok = policy.seat_victim_ok
                if not policy.preempts_for_seat(waiting):
                    return False
            else:
                ok = policy.admission_victim_ok
                num_blocks = memory.blocks_to_admit(waiting, {})
                if not policy.preempts_for_admission(waiting, memory, num_blocks):
                    return False
            if not ok(waiting, req, memory):
                return False
            before = self.preemptor.victims_before(waiting, req, step, ok)
        # It comes back where the waiting request would take others first and they alone
        # make its room.
        back = list(taken)
        back[req.tier] += self._blocks_back(req, step)
        return not before or not self.preemptor.fits_after(waiting, before, back)

    def _takes_prompt_room(
        self, req: Request, head: Request, step: StepBudget, prefilling: list[Request]
    ) -> bool:
        """Whether swapped-out `req` coming back would leave `head` no step token after the
        running prompts' chunks and its own (or its decode)."""
        cap = self.policy.prefill_chunk_cap
        if req.is_prefilling:
            return not _prompt_room_after(head, step, [*prefilling, req], cap)
        return not _prompt_room_after(head, step, prefilling, cap, num_decodes=1)

    def _blocks_back(self, req: Request, step: StepBudget) -> int:
        """The blocks swapped-out `req` takes coming back in this pass: its own, and for a
        decode the one its next token may need (`_swap_in` grows it)."""
        if req.is_prefilling or step.tokens_left < 1:
            return len(req.host_block_ids)
        return max(len(req.host_block_ids), self.memory.blocks_for(req.num_tokens))

    def _prefill_running(self, step: StepBudget, prefilling: list[Request]) -> None:
        for req in prefilling:
            if step.tokens_left < 1:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # taken as a victim after it was listed
            chunk = step.chunk_for(req, self.policy.prefill_chunk_cap(req))
            if chunk >= 1 and self.memory.grow(req, req.num_computed_tokens + chunk) is Alloc.OK:
                step.add_prefill(req, chunk)

    def _admit(self, step: StepBudget, now: float) -> None:
        policy, life, memory = self.policy, self.lifecycle, self.memory
        while step.tokens_left >= 1:
            req = policy.peek(now)
            if req is None or not step.has_prefill_room(req.tier):
                break  # admitted without a token to run, it would only hold a seat
            if any(policy.returns_first(s, req) for s in life.swapped):
                break
            if not policy.may_admit(req, memory):
                break
            if len(life.running) >= step.seats and not self.preemptor.free_seat_for(req, step, now):
                break
            status = memory.admit(req)
            if status is Alloc.NO_SPACE:
                status = self.preemptor.reclaim_for(req, step, now)
            if status is Alloc.OVER_CEILING and policy.holds_tiers:
                # Only its own tier's running requests can make room for it: the tiers behind
                # it need not wait with it.
                policy.hold_tier(req.tier)
                continue
            if status is not Alloc.OK:
                self._note_memory_wait(req, status)
                break
            popped = policy.pop(now)
            if popped is not req:
                raise PolicyOrderError(
                    f"{policy.name}: pop() gave {popped.request_id}, peek() {req.request_id}"
                )
            life.admit(req, now)
            step.fresh.add(req)
            chunk = step.chunk_for(req, policy.prefill_chunk_cap(req))
            if chunk >= 1:
                step.add_prefill(req, chunk)

    # ---- fast simulation: a pass known to do nothing but decode ---------------------------

    def decodes_only(self, taken: Sequence[int], now: float) -> bool:
        """Fast simulation (engine/leap.py), for a step in which every running request
        decodes and `taken[t]` new blocks go to tier t's decodes while requests wait or are
        swapped out: whether the pass would shed, swap in, admit and preempt nobody. If so,
        its policy hooks have run and its counts are kept, as the pass leaves them, and the
        step is the leap's to run; if not (or where the pass might preempt), nothing has
        changed that the pass does not redo. The checks are the pass's own, in its order,
        on the memory as the decodes' blocks would leave it (`check_after`)."""
        policy, life, memory = self.policy, self.lifecycle, self.memory
        if self._forced or policy.to_shed(now):
            return False
        cfg = self.config.scheduler
        step = StepBudget(
            cfg.max_num_batched_tokens, cfg.max_num_seqs, estimate_s=self.executor.estimate_prefill_s
        )
        policy.begin_step(step, life.running, now, prefilling=())
        step.add_decodes(life.running)
        for req in life.swapped:  # `_swap_in`
            if len(life.running) >= step.seats:
                break
            if not policy.may_swap_in(req):
                continue
            status = memory.check_after(req.tier, len(req.host_block_ids), taken)
            if status is Alloc.OK:
                return False  # it would come back
            if status is not Alloc.OVER_CEILING or not policy.tiered_memory:
                break
        waited = self._admits_nobody(step, taken, now)
        if waited is False:
            return False
        policy.end_step(step, now)
        if waited is not True:
            waited.num_memory_waits += 1
        return True

    def _admits_nobody(self, step: StepBudget, taken: Sequence[int], now: float) -> bool | Request:
        """`_admit`'s first round without its effects: False if it might admit or preempt;
        else True, or the head if the pass counts a memory wait for it."""
        policy, life, memory = self.policy, self.lifecycle, self.memory
        if step.tokens_left < 1:
            return True
        req = policy.peek(now)
        if req is None or not step.has_prefill_room(req.tier):
            return True
        if any(policy.returns_first(s, req) for s in life.swapped) or not policy.may_admit(req, memory):
            return True
        if len(life.running) >= step.seats:
            return not policy.preempts_for_seat(req)
        status = memory.admit_status_after(req, taken)
        if status is Alloc.OK or (status is Alloc.OVER_CEILING and policy.holds_tiers):
            return False  # it, or (its tier held) a request of another tier, might be admitted
        if status is Alloc.NO_SPACE:
            if policy.preempts_for_admission(req, memory, memory.blocks_to_admit(req, {}, taken)):
                return False
            if any(memory.used_blocks(t) + taken[t] for t in ALL_TIERS[req.tier + 1 :]):
                return req  # `_note_memory_wait`
        return True

    def _note_memory_wait(self, req: Request, status: Alloc) -> None:
        """Count a pass in which `req` found no room (after any reclaim its policy allows)
        while a lower tier held blocks: memory it had to wait for, not its own ceiling."""
        lower = ALL_TIERS[req.tier + 1 :]
        if status is Alloc.NO_SPACE and any(self.memory.used_blocks(t) for t in lower):
            req.num_memory_waits += 1


def _prompt_room_after(
    head: Request,
    step: StepBudget,
    prompts: list[Request],
    chunk_cap: Callable[[Request], int | None],
    num_decodes: int = 0,
) -> bool:
    """Whether a prompt of `head`'s tier could still get a token in `step` once `num_decodes`
    decodes and the chunks of `prompts` had taken theirs (at most each prompt's whole rest,
    its `chunk_cap` (the policy's) and the cap on its tier's prompts)."""
    return _PromptRoom(step, chunk_cap, prompts, num_decodes).fits(head)


class _PromptRoom:
    """A step's tokens (and its capped tiers' share) left once the chunks of the prompts
    added so far have taken theirs, in order, as `_prompt_room_after` counts them: one
    prompt at a time, so that a pass reading many waiting requests counts each once."""

    def __init__(
        self,
        step: StepBudget,
        chunk_cap: Callable[[Request], int | None],
        prompts: list[Request],
        num_decodes: int = 0,
    ) -> None:
        self._step, self._chunk_cap = step, chunk_cap
        self._tokens, self._capped = step.tokens_left - num_decodes, step.capped_tokens_left
        for req in prompts:
            self.add(req)

    def fits(self, req: Request) -> bool:
        """Whether a prompt of `req`'s tier would still get a token."""
        return self._tokens >= 1 and (req.tier not in self._step.capped_tiers or self._capped >= 1)

    def add(self, req: Request) -> None:
        n = min(req.num_tokens - req.num_computed_tokens, self._tokens)
        cap = self._chunk_cap(req)
        if cap is not None:
            n = min(n, cap)
        if req.tier in self._step.capped_tiers:
            n = min(n, self._capped)
            self._capped -= n
        self._tokens -= n
