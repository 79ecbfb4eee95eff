"""The async side of routing and flow control: requests wait here for an upstream with room.

A request is routed at once while no request of the gateway is waiting and some
upstream is not saturated; otherwise it takes a ticket in the flow control and waits.
`pump` hands tickets out, in the policy's order, while upstreams have room; it runs
when a request ends, after each scrape and on a short timer (for aging and expiry).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from tierserve.clock import Clock
from tierserve.gateway.flow import FlowControl, Refusal
from tierserve.gateway.metrics import GatewayMetrics
from tierserve.gateway.router import RouteDecision, Router
from tierserve.request import Request
from tierserve.server.errors import ApiError
from tierserve.server.refusals import overloaded
from tierserve.tiers import Tier


class QueueOrderError(RuntimeError):
    """The flow control released a ticket other than the one it showed at the same time."""


def no_upstream(model: str) -> ApiError:
    return ApiError(
        503,
        f"No healthy upstream serves model {model!r} right now.",
        type="server_error",
        code="no_upstream",
        headers={"Retry-After": "1"},
        extra={"retry_after": 1.0},
    )


@dataclass
class _Waiter:
    ticket: Request
    future: asyncio.Future[RouteDecision]
    model: str
    prefix: str
    exclude: tuple[str, ...]


class Dispatcher:
    def __init__(self, router: Router, flow: FlowControl, metrics: GatewayMetrics, clock: Clock) -> None:
        self._router = router
        self._flow = flow
        self._metrics = metrics
        self._clock = clock
        self._waiters: dict[str, _Waiter] = {}

    def _take(self, decision: RouteDecision) -> RouteDecision:
        self._router.started(decision.upstream)
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
    ) -> RouteDecision:
        """An upstream for the request (counted in flight: call `finished` once it ends).
        Raises `ApiError` 503 when none serves the model, or its tier's queue is full or too slow."""
        if not self._router.candidates(model, exclude):
            raise no_upstream(model)
        if not len(self._flow):
            decision = self._router.route(tier, prefix, model, exclude)
            if decision is not None:
                return self._take(decision)
        ticket = self._flow.offer(tier, tenant, num_tokens=num_tokens, tenant_weight=tenant_weight)
        if isinstance(ticket, Refusal):
            self._metrics.reject("queue_full", tier)
            raise overloaded(tier, "queue_full", ticket.retry_after_s, ticket.queue_depth, None, {})
        self._metrics.decisions.labels("queued").inc()
        future: asyncio.Future[RouteDecision] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.request_id] = _Waiter(ticket, future, model, prefix, tuple(exclude))
        self.pump()
        try:
            return await future
        except asyncio.CancelledError:  # the client went away while waiting
            if self._waiters.pop(ticket.request_id, None) is not None:
                self._flow.cancel(ticket)
            elif future.done() and not future.cancelled() and future.exception() is None:
                self.finished(future.result().upstream)  # routed just as it left
            raise

    def finished(self, upstream: str) -> None:
        self._router.finished(upstream)
        self._flow.drained()
        self.pump()

    def pump(self) -> None:
        for ticket in self._flow.expire():
            waiter = self._waiters.pop(ticket.request_id, None)
            if waiter is None or waiter.future.done():
                continue
            self._metrics.reject("queue_timeout", ticket.tier)
            waiter.future.set_exception(
                overloaded(ticket.tier, "queue_timeout", self._flow.retry_after(ticket.tier), 0, None, {})
            )
        while True:
            now = self._clock.now()
            head = self._flow.peek(now)
            if head is None:
                return
            waiter = self._waiters[head.request_id]
            decision = self._router.route(head.tier, waiter.prefix, waiter.model, waiter.exclude)
            if decision is None:
                return
            released = self._flow.release(now)
            if released is not head:
                raise QueueOrderError(f"peeked {head.request_id}, released {released}")
            del self._waiters[head.request_id]
            self._metrics.queue_wait.labels(head.tier.name).observe(self._flow.waited(head))
            if waiter.future.done():  # cancelled between its last await and now
                continue
            waiter.future.set_result(self._take(decision))
