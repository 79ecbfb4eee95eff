"""The gateway's dispatch in virtual time: route at once, or wait in the flow control.

The decisions are the gateway's own `DispatchCore` (the one its asyncio `Dispatcher`
wraps), over its `Router` and `FlowControl`; here a waiting request is a key the fleet
looks up, not a future. The plain routers never return None while a candidate is left,
so their flow control stays empty: they never hold a request back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tierserve.clock import Clock
from tierserve.gateway.dispatch_core import DispatchCore, Dropped
from tierserve.gateway.flow import FlowControl, Refusal
from tierserve.gateway.router import RouteDecision, Router
from tierserve.tiers import Tier

MODEL = "fleet-model"


@dataclass
class DispatchOutcome:
    routed: list[tuple[int, str]] = field(default_factory=list)  # (key, upstream)
    refused: list[tuple[int, str]] = field(default_factory=list)  # (key, reason)
    queued: bool = False


class FleetDispatch:
    def __init__(self, router: Router, flow: FlowControl, clock: Clock) -> None:
        self.router = router
        self.flow = flow
        self._core: DispatchCore[int] = DispatchCore(router, flow, clock)
        self.num_routed_by_reason: dict[str, int] = {}

    def _routed(self, key: int, decision: RouteDecision, out: DispatchOutcome) -> None:
        reason = decision.reason
        self.num_routed_by_reason[reason] = self.num_routed_by_reason.get(reason, 0) + 1
        out.routed.append((key, decision.upstream))

    def submit(
        self, key: int, tier: Tier, prefix: str, exclude: Sequence[str] = (), waited_s: float = 0.0
    ) -> DispatchOutcome:
        """Route the request at once or queue it; `waited_s`: a retried request's time in the
        queue before (it keeps its place and the wait it has left, as in the gateway)."""
        out = DispatchOutcome()
        if not self.router.candidates(MODEL, exclude):
            out.refused.append((key, "no_upstream"))
            return out
        decision = self._core.route_now(tier, prefix, MODEL, exclude)
        if decision is not None:
            self._routed(key, decision, out)
            return out
        ticket = self._core.enqueue(key, tier, f"t{int(tier)}", MODEL, prefix, exclude, waited_s=waited_s)
        if isinstance(ticket, Refusal):
            out.refused.append((key, "queue_full"))
            return out
        out.queued = True
        self._pump(out)
        return out

    def finished(self, upstream: str, tier: Tier) -> DispatchOutcome:
        self._core.finished(upstream, tier)
        return self.pump()

    def pump(self) -> DispatchOutcome:
        out = DispatchOutcome()
        self._pump(out)
        return out

    def _pump(self, out: DispatchOutcome) -> None:
        for event in self._core.pump():
            if isinstance(event, Dropped):
                out.refused.append((event.handle, event.reason))
            else:
                self._routed(event.handle, event.decision, out)

    def depth(self, tier: Tier | None = None) -> int:
        return self.flow.depth(tier)
