"""The async side of routing and flow control: requests wait here for an upstream with room.

The decisions are `DispatchCore`'s (shared with the fleet simulation): a request is
routed at once unless a request of its tier or a more urgent one waits in the gateway, or
every upstream is full for its tier; then it takes a ticket and awaits a future. `pump`
settles the futures of the tickets the core releases or drops; it runs when a request
ends, after each scrape and on a short timer (for aging and expiry).

Each request the dispatcher takes is counted once, by how it left it: a routing decision
(`affinity`, `least_loaded` or `p0_soonest`, when it is sent on, at once or after waiting;
it then ends in one upstream outcome) or a rejection (`queue_full`, `queue_timeout`,
`no_upstream`, `client_left` for a client gone while it waited, or `cut` for one still
waiting when the gateway's drain ended), so that the counts add up to the requests
(docs/gateway.md, "Metrics").
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from tierserve.clock import Clock
from tierserve.gateway.dispatch_core import NO_UPSTREAM_RETRY_S, DispatchCore, Dropped
from tierserve.gateway.flow import FlowControl, Refusal
from tierserve.gateway.metrics import GatewayMetrics
from tierserve.gateway.router import RouteDecision, Router
from tierserve.server.errors import ApiError
from tierserve.server.refusals import overloaded
from tierserve.tiers import Tier


def no_upstream(model: str) -> ApiError:
    return ApiError(
        503,
        f"No healthy upstream serves model {model!r} right now.",
        type="server_error",
        code="no_upstream",
        headers={"Retry-After": str(math.ceil(NO_UPSTREAM_RETRY_S))},
        extra={"retry_after": NO_UPSTREAM_RETRY_S},
    )


_Handle = tuple[asyncio.Future[RouteDecision], str]  # the waiting request's future, its model


class Dispatcher:
    def __init__(self, router: Router, flow: FlowControl, metrics: GatewayMetrics, clock: Clock) -> None:
        self._router = router
        self._core: DispatchCore[_Handle] = DispatchCore(router, flow, clock)
        self._metrics = metrics
        # Set when the gateway's drain cuts what is left: a request that leaves the queue (or
        # an upstream) then was cut (`cut`), not given up by its client (`client_left`).
        self.cutting = False

    def _counted(self, decision: RouteDecision) -> RouteDecision:
        self._metrics.decisions.labels(decision.reason).inc()
        return decision

    async def acquire(
        self,
        tier: Tier,
        tenant: str,
        model: str,
        prefix: str,
        *,
        num_tokens: int = 1,
        tenant_weight: float = 1.0,
        exclude: Sequence[str] = (),
        waited_s: float = 0.0,
    ) -> RouteDecision:
        """An upstream for the request (counted in flight: call `finished` once it ends).
        Raises `ApiError` 503 when none serves the model, or its tier's queue is full or too
        slow. `waited_s`: a retried request's time in the queue on its earlier attempts (it
        keeps its place and the wait it has left); the decision's `waited_s` is this one's."""
        if not self._router.candidates(model, exclude):
            self._metrics.reject("no_upstream", tier)
            raise no_upstream(model)
        decision = self._core.route_now(tier, prefix, model, exclude)
        if decision is not None:
            return self._counted(decision)
        future: asyncio.Future[RouteDecision] = asyncio.get_running_loop().create_future()
        ticket = self._core.enqueue(
            (future, model),
            tier,
            tenant,
            model,
            prefix,
            exclude,
            num_tokens=num_tokens,
            tenant_weight=tenant_weight,
            waited_s=waited_s,
        )
        if isinstance(ticket, Refusal):
            self._metrics.reject("queue_full", tier)
            raise overloaded(tier, "queue_full", ticket.retry_after_s, ticket.queue_depth, None, {})
        self.pump()
        try:
            decision = await future
        except asyncio.CancelledError:  # the client went away while waiting
            self._core.cancel(ticket)  # out of the queue, where it still is
            if future.done() and not future.cancelled():
                if future.exception() is not None:
                    raise  # refused just as it left: counted as that refusal
                self.finished(future.result())  # routed just as it left: it never went out
            self._metrics.reject("cut" if self.cutting else "client_left", tier)
            raise
        # Counted as it goes out, not as it is released: one released just as its client
        # left never reaches an upstream (and is counted `client_left` above).
        return self._counted(decision)

    def finished(self, decision: RouteDecision) -> None:
        self._core.finished(decision.upstream, decision.tier)
        self.pump()

    def pump(self) -> None:
        for event in self._core.pump():
            future, model = event.handle
            if isinstance(event, Dropped):
                if not future.done():
                    future.set_exception(self._refusal(event, model))
                continue
            if future.done():  # cancelled between its last await and now: it never went out
                self._router.finished(event.decision.upstream, event.decision.tier)
                continue
            self._metrics.queue_wait.labels(event.decision.tier.name).observe(event.decision.waited_s)
            future.set_result(event.decision)

    def _refusal(self, dropped: Dropped[_Handle], model: str) -> ApiError:
        self._metrics.reject(dropped.reason, dropped.tier)
        if dropped.reason == "no_upstream":
            return no_upstream(model)
        return overloaded(dropped.tier, dropped.reason, dropped.retry_after_s, dropped.queue_depth, None, {})
