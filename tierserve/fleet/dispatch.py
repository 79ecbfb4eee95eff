"""The gateway's dispatch in virtual time: route at once, or wait in the flow control.

The same decisions as `tierserve.gateway.dispatcher.Dispatcher`, with its `Router` and
`FlowControl` classes, minus the asyncio futures: a request is routed at once while no
request waits and some upstream is not saturated; otherwise it takes a ticket and waits.
`pump` expires tickets that waited too long and hands the rest out in the policy's order
while upstreams have room. Without flow control (the plain routers) a request goes to a
candidate whatever its load, and is refused only when no candidate is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tierserve.clock import Clock
from tierserve.gateway.flow import FlowControl, Refusal
from tierserve.gateway.router import Router
from tierserve.tiers import Tier

MODEL = "fleet-model"


class QueueOrderError(RuntimeError):
    """The flow control released a ticket other than the one it showed at the same time."""


@dataclass
class Pending:
    """A request waiting in the gateway: its key (for the caller) and where it may not go."""

    key: int
    tier: Tier
    prefix: str
    exclude: tuple[str, ...]


@dataclass
class DispatchOutcome:
    routed: list[tuple[int, str]] = field(default_factory=list)  # (key, upstream)
    refused: list[tuple[int, str]] = field(default_factory=list)  # (key, reason)
    queued: bool = False


class FleetDispatch:
    def __init__(self, router: Router, flow: FlowControl | None, clock: Clock) -> None:
        self.router = router
        self.flow = flow
        self._clock = clock
        self._waiting: dict[str, Pending] = {}  # ticket id -> request
        self.num_routed_by_reason: dict[str, int] = {}

    def _take(self, key: int, upstream: str, reason: str, out: DispatchOutcome) -> None:
        self.router.started(upstream)
        self.num_routed_by_reason[reason] = self.num_routed_by_reason.get(reason, 0) + 1
        out.routed.append((key, upstream))

    def submit(self, key: int, tier: Tier, prefix: str, exclude: Sequence[str] = ()) -> DispatchOutcome:
        out = DispatchOutcome()
        if not self.router.candidates(MODEL, exclude):
            out.refused.append((key, "no_upstream"))
            return out
        if self.flow is None or not len(self.flow):
            decision = self.router.route(tier, prefix, MODEL, exclude)
            if decision is not None:
                self._take(key, decision.upstream, decision.reason, out)
                return out
        if self.flow is None:
            out.refused.append((key, "no_upstream"))
            return out
        ticket = self.flow.offer(tier, f"t{int(tier)}")
        if isinstance(ticket, Refusal):
            out.refused.append((key, "queue_full"))
            return out
        self._waiting[ticket.request_id] = Pending(key, tier, prefix, tuple(exclude))
        out.queued = True
        self._pump(out)
        return out

    def finished(self, upstream: str) -> DispatchOutcome:
        self.router.finished(upstream)
        if self.flow is not None:
            self.flow.drained()
        return self.pump()

    def pump(self) -> DispatchOutcome:
        out = DispatchOutcome()
        self._pump(out)
        return out

    def _pump(self, out: DispatchOutcome) -> None:
        if self.flow is None:
            return
        for ticket in self.flow.expire():
            pending = self._waiting.pop(ticket.request_id)
            out.refused.append((pending.key, "queue_timeout"))
        while True:
            now = self._clock.now()
            head = self.flow.peek(now)
            if head is None:
                return
            pending = self._waiting[head.request_id]
            decision = self.router.route(head.tier, pending.prefix, MODEL, pending.exclude)
            if decision is None:
                if not self.router.candidates(MODEL, pending.exclude):
                    self.flow.cancel(head)
                    del self._waiting[head.request_id]
                    out.refused.append((pending.key, "no_upstream"))
                    continue
                return
            released = self.flow.release(now)
            if released is not head:
                raise QueueOrderError(f"peeked {head.request_id}, released {released}")
            del self._waiting[head.request_id]
            self._take(pending.key, decision.upstream, decision.reason, out)

    def depth(self, tier: Tier | None = None) -> int:
        return self.flow.depth(tier) if self.flow is not None else 0
