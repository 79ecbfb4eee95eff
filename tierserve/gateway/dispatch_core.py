"""Route at once or wait in the flow control: the decisions the gateway's `Dispatcher`
(asyncio futures) and the fleet simulation's `FleetDispatch` (virtual time) share.

A request of tier t is routed at once when no request for its model of tier t or more
urgent waits in the gateway and some upstream is not full for t (waiting requests of less
urgent tiers would start after it on the upstream anyway); otherwise it takes a ticket.
`pump` expires tickets that waited too long, refuses those no candidate is left for, and
releases the rest in the policy's order while the head can be routed (past a head with no
room, its model's more urgent requests, and other models' requests, may still go:
`_release`). A routed request counts in flight at once, so the next decision sees it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from tierserve.clock import Clock
from tierserve.gateway.flow import FlowControl, Refusal
from tierserve.gateway.router import RouteDecision, Router
from tierserve.request import Request
from tierserve.tiers import Tier

H = TypeVar("H")  # what the caller keeps for a waiting request (a future, a key)
NO_UPSTREAM_RETRY_S = 1.0  # retry_after when no healthy upstream serves the model


class QueueOrderError(RuntimeError):
    """The flow control released a ticket other than the one it showed at the same time."""


@dataclass(frozen=True, slots=True)
class Released(Generic[H]):
    handle: H
    decision: RouteDecision  # already counted in flight; `waited_s`: its time in the queue


@dataclass(frozen=True, slots=True)
class Dropped(Generic[H]):
    handle: H
    tier: Tier
    reason: str  # "queue_timeout" or "no_upstream"
    retry_after_s: float
    queue_depth: int  # requests still waiting in its tier's queue, as a `queue_full` refusal says


@dataclass(frozen=True, slots=True)
class _Held(Generic[H]):
    handle: H
    ticket: Request
    model: str
    group: str  # its queue in the flow control
    prefix: str
    exclude: tuple[str, ...]
    waited_before_s: float  # in the queue on earlier attempts


ALL_MODELS = "*"  # the queue of every model, where an upstream serves any


def model_groups(served: Iterable[tuple[str, frozenset[str]]]) -> dict[str, str]:
    """Each model's group, from each upstream's (name, models it lists): the models served
    by the same upstreams, named by those upstreams (models sharing only some upstreams are
    apart: a head of one with no room held back the other, whose own upstream was idle).
    Empty where an upstream lists no model (it serves any): one queue for every model."""
    upstreams_of: dict[str, list[str]] = {}
    for name, models in served:
        if not models:
            return {}
        for model in models:
            upstreams_of.setdefault(model, []).append(name)
    return {model: "\0".join(sorted(names)) for model, names in upstreams_of.items()}


class DispatchCore(Generic[H]):
    def __init__(self, router: Router, flow: FlowControl, clock: Clock) -> None:
        self.router = router
        self.flow = flow
        self._clock = clock
        self._held: dict[str, _Held[H]] = {}  # ticket id -> request
        self._served: tuple[tuple[str, frozenset[str]], ...] | None = None
        self._groups: dict[str, str] = {}

    def group(self, model: str) -> str:
        """The flow control's queue for `model`: one per group of models the same upstreams
        serve (`model_groups`). Apart, a backlog on one model held another's requests
        while that model's upstreams sat idle; one queue for models that share upstreams
        keeps the policy's tenant fairness and aging among them (vLLM lists each LoRA adapter
        as a model of its own)."""
        # An upstream not yet admitted lists no model yet: not one that serves any.
        served = tuple((s.name, s.models) for s in self.router.states if s.healthy or s.models)
        if served != self._served:
            self._served, self._groups = served, model_groups(served)
        return self._groups.get(model, ALL_MODELS if not self._groups else model)

    def route_now(
        self, tier: Tier, prefix: str, model: str, exclude: Sequence[str] = ()
    ) -> RouteDecision | None:
        """An upstream now (counted in flight), or None: the request must take a ticket (a
        closed tier's is refused: a queue cap of 0 closed it in `serve` and not here, so a
        server's config put in front of a gateway opened the tier again)."""
        if self.flow.depth_upto(tier, self.group(model)) or self.flow.is_closed(tier):
            return None
        decision = self.router.route(tier, prefix, model, exclude)
        if decision is not None:
            self.router.started(decision.upstream, tier)
        return decision

    def enqueue(
        self,
        handle: H,
        tier: Tier,
        tenant: str,
        model: str,
        prefix: str,
        exclude: Sequence[str] = (),
        *,
        num_tokens: int = 1,
        tenant_weight: float = 1.0,
        waited_s: float = 0.0,
    ) -> Request | Refusal:
        """A ticket in the tier queues (call `pump` next), or the refusal of a full queue.
        `waited_s`: a retried request's time in the queue before (`FlowControl.offer`)."""
        group = self.group(model)
        ticket = self.flow.offer(
            tier, tenant, model=group, num_tokens=num_tokens, tenant_weight=tenant_weight, waited_s=waited_s
        )
        if isinstance(ticket, Request):
            self._held[ticket.request_id] = _Held(
                handle, ticket, model, group, prefix, tuple(exclude), waited_s
            )
        return ticket

    def cancel(self, ticket: Request) -> bool:
        """Take out a ticket whose client went away; False when it had left the queue already."""
        if self._held.pop(ticket.request_id, None) is None:
            return False
        self.flow.cancel(ticket)
        return True

    def finished(self, upstream: str, tier: Tier) -> None:
        """A routed request ended (call `pump` next: its place may go to a waiting one)."""
        self.router.finished(upstream, tier)
        self.flow.drained()

    def pump(self) -> list[Released[H] | Dropped[H]]:
        """What became of waiting requests: expired, left without a candidate, or released."""
        out: list[Released[H] | Dropped[H]] = []
        for ticket in self.flow.expire():
            held = self._held.pop(ticket.request_id)
            tier, group = ticket.tier, held.group
            retry_after = self.flow.retry_after(tier, group)
            out.append(Dropped(held.handle, tier, "queue_timeout", retry_after, self.flow.depth(tier, group)))
        try:
            self._release(out)
        finally:
            self.flow.end_pass()
        return out

    def _release(self, out: list[Released[H] | Dropped[H]]) -> None:
        """Release waiting requests in the policy's order while the head can be routed. A
        head no upstream has room for waits, and so do its model's requests of its tier and
        the less urgent ones; a more urgent request for that model behind it (a P3 aged to
        the head, a P1 behind it) may still go where the policy can set tiers aside (it had
        waited behind a P3 request on upstreams with room for P1 and P2), and so may other
        models' requests (they had waited behind another model's backlog while their own
        upstreams sat idle)."""
        stepped_aside: list[Request] = []
        try:
            self._release_heads(out, stepped_aside)
        finally:
            for ticket in reversed(stepped_aside):  # back in its place, as it was
                self.flow.readmit(ticket)

    def _release_heads(self, out: list[Released[H] | Dropped[H]], stepped_aside: list[Request]) -> None:
        while True:
            now = self._clock.now()
            head = self.flow.peek(now)
            if head is None:
                return
            held = self._held[head.request_id]
            decision = self.router.route(head.tier, held.prefix, held.model, held.exclude)
            if decision is None:
                if held.exclude and self.router.route(head.tier, held.prefix, held.model) is not None:
                    # Room only on upstreams this retried request failed on: it waits, and the
                    # requests behind it may go there (it held its model's tier back).
                    self.flow.step_aside(head, now)
                    stepped_aside.append(head)
                    continue
                if self.router.candidates(held.model, held.exclude):
                    self.flow.set_aside(head.tier, held.group)  # the head waits for room
                    continue
                self.cancel(head)
                depth = self.flow.depth(head.tier, held.group)
                out.append(Dropped(held.handle, head.tier, "no_upstream", NO_UPSTREAM_RETRY_S, depth))
                continue
            released = self.flow.release(now)
            if released is not head:
                raise QueueOrderError(f"peeked {head.request_id}, released {released}")
            del self._held[head.request_id]
            self.router.started(decision.upstream, head.tier)
            waited_s = self.flow.waited(head) - held.waited_before_s  # on this attempt
            out.append(Released(held.handle, replace(decision, waited_s=waited_s)))
