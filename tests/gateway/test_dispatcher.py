"""The dispatcher: requests wait while every upstream is saturated and leave in tier order."""

from __future__ import annotations

import asyncio

import pytest

from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig
from tierserve.gateway.config import GatewaySettings, UpstreamConfig
from tierserve.gateway.dispatcher import Dispatcher
from tierserve.gateway.flow import FlowControl
from tierserve.gateway.metrics import GatewayMetrics
from tierserve.gateway.router import Router
from tierserve.gateway.saturation import LoadSample
from tierserve.server.errors import ApiError
from tierserve.tiers import ALL_TIERS, Tier


def _dispatcher(cap: int = 1, queue_cap: int = 8) -> tuple[Dispatcher, Router, VirtualClock]:
    clock = VirtualClock()
    up = UpstreamConfig("only", "openai", "http://127.0.0.1:1", max_in_flight=cap)
    router = Router([up], GatewaySettings(), clock)
    router.record_success("only")
    waits = {t: 10.0 for t in ALL_TIERS}
    flow = FlowControl(EngineConfig(), "hybrid", {t: queue_cap for t in ALL_TIERS}, waits, clock)
    return Dispatcher(router, flow, GatewayMetrics(), clock), router, clock


def test_a_saturated_fleet_queues_and_releases_by_tier_as_requests_finish() -> None:
    async def run() -> list[Tier]:
        d, router, _ = _dispatcher(cap=1)
        first = await d.acquire(Tier.P2, "t", "m", "p")
        order: list[Tier] = []

        async def one(tier: Tier) -> None:
            decision = await d.acquire(tier, "t", "m", "p")
            order.append(tier)
            await asyncio.sleep(0)
            d.finished(decision)

        tasks = [asyncio.create_task(one(t)) for t in (Tier.P3, Tier.P2, Tier.P1, Tier.P0)]
        await asyncio.sleep(0.01)
        assert order == [] and router.state("only").num_in_flight == 1
        d.finished(first)
        await asyncio.gather(*tasks)
        assert router.state("only").num_in_flight == 0
        return order

    assert asyncio.run(run()) == [Tier.P0, Tier.P1, Tier.P2, Tier.P3]


def test_a_full_queue_is_a_503_and_a_client_that_leaves_frees_its_place() -> None:
    async def run() -> None:
        d, _router, _ = _dispatcher(cap=1, queue_cap=1)
        first = await d.acquire(Tier.P1, "t", "m", "p")
        waiting = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p"))
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as refused:
            await d.acquire(Tier.P1, "t", "m", "p")
        assert refused.value.status == 503 and refused.value.code == "queue_full"
        waiting.cancel()
        await asyncio.sleep(0.01)
        again = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p"))  # the place is free again
        await asyncio.sleep(0.01)
        d.finished(first)
        assert (await again).upstream == "only"

    asyncio.run(run())


def test_a_request_waiting_past_its_tiers_limit_gets_a_503() -> None:
    async def run() -> None:
        d, _, clock = _dispatcher(cap=1)
        await d.acquire(Tier.P1, "t", "m", "p")
        waiting = asyncio.create_task(d.acquire(Tier.P0, "t", "m", "p"))
        await asyncio.sleep(0.01)
        clock.elapse(11.0)
        d.pump()
        with pytest.raises(ApiError) as late:
            await waiting
        assert late.value.code == "queue_timeout"

    asyncio.run(run())


def test_a_p0_goes_at_once_to_the_best_replica_while_less_urgent_requests_wait() -> None:
    async def run() -> None:
        clock = VirtualClock()
        ups = [UpstreamConfig(f"u{i}", "tierserve", f"http://127.0.0.1:{i + 1}") for i in range(3)]
        router = Router(ups, GatewaySettings(max_waiting=4), clock)
        for up, by_tier in zip(ups, [(1, 0, 4, 4), (0, 1, 4, 4), (2, 0, 4, 4)], strict=True):
            router.record_success(up.name)
            router.record_sample(up.name, LoadSample(sum(by_tier), 8, 0.5, clock.now(), by_tier))
        flow = FlowControl(
            EngineConfig(), "hybrid", {t: 8 for t in ALL_TIERS}, {t: 10.0 for t in ALL_TIERS}, clock
        )
        d = Dispatcher(router, flow, GatewayMetrics(), clock)
        held = asyncio.create_task(d.acquire(Tier.P2, "t", "m", "p"))  # every replica is full for P2
        await asyncio.sleep(0.01)
        assert not held.done() and flow.depth(Tier.P2) == 1
        decision = await asyncio.wait_for(d.acquire(Tier.P0, "t", "m", "p"), 1.0)
        assert (decision.upstream, decision.reason) == ("u1", "p0_soonest")
        assert flow.depth(Tier.P0) == 0 and router.state("u1").in_flight[Tier.P0] == 1
        held.cancel()

    asyncio.run(run())


def test_a_waiting_request_whose_last_upstream_is_ejected_gets_a_503_at_once() -> None:
    async def run() -> None:
        d, router, _ = _dispatcher(cap=1)
        await d.acquire(Tier.P1, "t", "m", "p")
        waiting = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p"))
        await asyncio.sleep(0.01)
        router.record_failure("only", eject_now=True)
        d.pump()
        with pytest.raises(ApiError) as refused:
            await waiting
        assert (refused.value.status, refused.value.code) == (503, "no_upstream")

    asyncio.run(run())
