"""vLLM's waiting queue, ordered by a tierserve policy.

Implements vLLM's `RequestQueue` on top of `tierserve.scheduling.Policy`: the same policy
objects (hybrid with aging by default) that order tierserve's own engine. The policy's
clock is frozen for a whole scheduling pass (`tick`), so a `peek` and the `pop` that
follows it always agree. Removing a request that is not queued here is a no-op, as in
vLLM's own queues (vLLM removes finished requests from every waiting queue at once).
For a step that carries one tier's work only, `show_only(tier)` hides every request
behind the last of that tier at the head: vLLM's admission loop then sees an empty queue.
`waiting_in(tier)` gives one tier's queued requests without a walk over the others (the
scheduler asks for the waiting P0 requests at every step while one waits: walking a queue
of 20,000 for them took 9 ms a step).

vLLM skips a waiting request it cannot run yet (its grammar still compiling, its LoRA
without a slot, its connector not yet knowing what it holds) by popping it and putting it
back at the end of the pass. Popping charges the request's tenant and tier in the policy's
fair order; a request put back in the pass that popped it (between `tick` and `end_pass`)
was skipped, so the policy gives the charge back (`Policy.put_back`, with the records
`keep_undo` keeps until `forget_undo` at the pass's end). Charged instead, a request
skipped for many steps (a LoRA waiting for a slot) cost its tenant a request's share at
every step.

A `gate` (set by the scheduler for vLLM's pass) skips the same way, from inside the queue,
a request vLLM's own checks would let through but must not run yet: the queue takes it
out for the rest of the pass and puts it back, uncharged, at `end_pass`; only while vLLM
could admit a request at all (`Gate.room`): vLLM asks whether the queue is empty before it
looks for a free seat, and a backlog the gate skipped at every step, seats full or not, cost
each step a pop and a put-back per request.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Protocol

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from tierserve.integrations.vllm.book import RequestBook
from tierserve.request import Request as ShadowRequest
from tierserve.scheduling import Policy
from tierserve.tiers import Tier


class Gate(Protocol):
    def room(self) -> bool:
        """Whether vLLM's pass may admit a request now (a seat is free)."""
        ...

    def admits(self, request: Request) -> bool:
        """Whether `request` may run now."""
        ...


class PolicyRequestQueue(RequestQueue):
    def __init__(self, policy: Policy, book: RequestBook) -> None:
        self.policy = policy
        policy.keep_undo(True)  # what a pass pops and vLLM skips goes back as it was
        self._book = book
        self._now = time.time()
        self._queued: list[dict[str, Request]] = [{} for _ in Tier]  # by tier, in the order queued
        # What each queued request is queued as, kept here: vLLM may end a request (and the
        # book forget it) before it takes the request out of the queue (a preempted request
        # that its last step's output stops, under async scheduling).
        self._shadows: dict[str, ShadowRequest] = {}
        self._only: Tier | None = None
        self._popped: set[str] = set()  # popped in this pass (since `tick`)
        # Whether a request at the head may run now (None: every one may), and what it
        # skipped in this pass.
        self.gate: Gate | None = None
        self._gated: list[ShadowRequest] = []

    def show_only(self, tier: Tier | None) -> None:
        """Until the next call, show only `tier`'s requests at the head (None: show all)."""
        self._only = tier

    def _head(self) -> Request | None:
        while True:
            shadow = self.policy.peek(self._now)
            if shadow is None or (self._only is not None and shadow.tier != self._only):
                return None
            request = self._book.get(shadow.request_id).vllm
            if self.gate is None or not self.gate.room() or self.gate.admits(request):
                return request
            self._gated.append(self.policy.pop(self._now))  # skipped until the pass ends

    def tick(self, now: float) -> None:
        """A scheduling pass begins: set the time the policy sees until the next tick (aging
        is evaluated against it)."""
        self._now = now
        self.end_pass()

    def end_pass(self) -> None:
        """The pass is over: what the gate skipped goes back, as if never popped; a request
        put back from now on was run (or preempted), not skipped."""
        for shadow in reversed(self._gated):  # the last skipped goes back first, as vLLM's do
            self.policy.put_back(shadow, self._now)
        self._gated.clear()
        self._popped.clear()
        self.policy.forget_undo()

    def waiting_in(self, tier: Tier) -> list[Request]:
        """The tier's queued requests, in the order they were queued (not the policy's)."""
        return list(self._queued[tier].values())

    def add_request(self, request: Request) -> None:
        self.policy.add(self._file(request), self._now)

    def pop_request(self) -> Request:
        if self._head() is None:
            raise IndexError("pop from an empty queue")
        shadow = self.policy.pop(self._now)
        del self._shadows[shadow.request_id]
        self._popped.add(shadow.request_id)
        return self._queued[shadow.tier].pop(shadow.request_id)

    def peek_request(self) -> Request:
        head = self._head()
        if head is None:
            raise IndexError("peek from an empty queue")
        return head

    def prepend_request(self, request: Request) -> None:
        if request.request_id in self._popped:  # skipped in this pass: as if never popped
            self._popped.discard(request.request_id)
            self.policy.put_back(self._file(request), self._now)
        else:  # preempted
            self.policy.prepend(self._file(request), self._now)

    def _file(self, request: Request) -> ShadowRequest:
        """Note `request` as queued, under its tier; returns its shadow, for the policy."""
        shadow = self._book.get(request.request_id).shadow
        self._queued[shadow.tier][request.request_id] = request
        self._shadows[request.request_id] = shadow
        return shadow

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        # Each goes to the head of its tier: the last of `requests` ends up first, as with
        # vLLM's own deque.extendleft.
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        shadow = self._shadows.pop(request.request_id, None)
        if shadow is not None:  # whatever the book still holds
            del self._queued[shadow.tier][request.request_id]
            gated = [g for g in self._gated if g is not shadow]
            if len(gated) < len(self._gated):
                self._gated = gated
            else:
                self.policy.remove(shadow)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.remove_request(request)

    def __bool__(self) -> bool:
        # What vLLM's admission loop asks before it peeks; `len` still counts every request.
        if self._only is None and self.gate is None:
            return len(self.policy) > 0
        return self._head() is not None

    def __len__(self) -> int:
        return len(self.policy) + len(self._gated)

    def __iter__(self) -> Iterator[Request]:
        for shadow in [*self.policy, *self._gated]:
            yield self._book.get(shadow.request_id).vllm
