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


def _dispatcher(
    cap: int = 1, queue_cap: int = 8, metrics: GatewayMetrics | None = None
) -> tuple[Dispatcher, Router, VirtualClock]:
    clock = VirtualClock()
    up = UpstreamConfig("only", "openai", "http://127.0.0.1:1", max_in_flight=cap)
    router = Router([up], GatewaySettings(), clock)
    router.record_success("only")
    waits = {t: 10.0 for t in ALL_TIERS}
    flow = FlowControl(EngineConfig(), "hybrid", {t: queue_cap for t in ALL_TIERS}, waits, clock)
    return Dispatcher(router, flow, metrics or GatewayMetrics(), clock), router, clock


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


def test_a_queue_timeout_says_how_many_wait_in_its_tiers_queue() -> None:
    """`current_queue_depth` was always 0 in a `queue_timeout` refusal (`queue_full` says
    the tier's queue): here two P1 requests still wait when the oldest runs out of time."""

    async def run() -> None:
        d, _, clock = _dispatcher(cap=1)
        await d.acquire(Tier.P1, "t", "m", "p")
        oldest = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p"))
        await asyncio.sleep(0.01)
        clock.elapse(5.0)
        later = [asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p")) for _ in range(2)]
        await asyncio.sleep(0.01)
        clock.elapse(6.0)  # the oldest has waited 11 s of its 10, the others 6
        d.pump()
        with pytest.raises(ApiError) as late:
            await oldest
        assert late.value.code == "queue_timeout"
        assert late.value.body()["error"]["current_queue_depth"] == 2
        for task in later:
            task.cancel()

    asyncio.run(run())


def test_each_request_the_dispatcher_sends_nowhere_is_counted_once_by_why() -> None:
    """Neither a client gone from the queue nor a `no_upstream` refusal was counted in any
    metric: a request routed once, one timed out, one whose client left, one left without
    an upstream while it waited and one that found none on arrival add up to five."""
    metrics = GatewayMetrics()

    def count(family: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(family + "_total", labels) or 0.0

    async def run() -> None:
        d, router, clock = _dispatcher(cap=1, metrics=metrics)
        await d.acquire(Tier.P1, "t", "m", "p")
        timed_out = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p"))
        await asyncio.sleep(0.01)
        clock.elapse(5.0)
        left = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p"))
        stranded = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p"))
        await asyncio.sleep(0.01)
        clock.elapse(6.0)
        d.pump()
        left.cancel()
        await asyncio.sleep(0.01)
        router.record_failure("only", eject_now=True)
        d.pump()
        for task, code in ((timed_out, "queue_timeout"), (stranded, "no_upstream")):
            with pytest.raises(ApiError) as refused:
                await task
            assert refused.value.code == code
        assert left.cancelled()
        with pytest.raises(ApiError):
            await d.acquire(Tier.P1, "t", "m", "p")  # none left on arrival

    asyncio.run(run())
    routed = sum(count("tierserve_gateway_routing_decisions", reason=r) for r in ("affinity", "least_loaded"))
    assert routed == 1 and count("tierserve_gateway_routing_decisions", reason="queued") == 0
    unsent = {
        reason: count("tierserve_rejections", reason=reason, priority="P1")
        for reason in ("queue_timeout", "client_left", "no_upstream")
    }
    assert unsent == {"queue_timeout": 1.0, "client_left": 1.0, "no_upstream": 2.0}


def test_a_more_urgent_request_goes_past_a_head_no_upstream_has_room_for() -> None:
    """A P3 request aged to the queue's head, on an upstream full for P3 but with room for
    P1 (it runs P1's work first): the P1 request behind it waited for the P3 one."""

    async def run() -> None:
        clock = VirtualClock()
        up = UpstreamConfig("u", "tierserve", "http://127.0.0.1:1")  # orders by priority
        router = Router([up], GatewaySettings(max_waiting=4), clock)
        router.record_success(up.name)
        router.record_sample(up.name, LoadSample(12, 8, 0.5, clock.now(), (0, 4, 4, 4)))
        flow = FlowControl(
            EngineConfig(), "hybrid", {t: 8 for t in ALL_TIERS}, {t: 1e6 for t in ALL_TIERS}, clock
        )
        d = Dispatcher(router, flow, GatewayMetrics(), clock)
        p3 = asyncio.create_task(d.acquire(Tier.P3, "t", "m", "p"))
        await asyncio.sleep(0.01)
        clock.elapse(6.0)  # past P3's aging (5 s): the head, ahead of any P1 that comes later
        p1 = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p"))
        await asyncio.sleep(0.01)
        assert flow.depth() == 2 and flow.peek().tier is Tier.P3  # type: ignore[union-attr]
        router.record_sample(up.name, LoadSample(4, 8, 0.5, clock.now(), (0, 0, 0, 4)))  # room for P1
        d.pump()
        assert (await asyncio.wait_for(p1, 1.0)).upstream == "u"
        assert not p3.done() and flow.peek().tier is Tier.P3  # type: ignore[union-attr]
        p3.cancel()

    asyncio.run(run())


def test_a_queue_cap_of_zero_closes_the_tier_as_serve_does() -> None:
    """With room upstream, a tier whose cap is 0 was still routed: a server's config put in
    front of a gateway opened the tier `serve` had closed."""

    async def run() -> None:
        d, router, _ = _dispatcher(cap=4, queue_cap=0)
        with pytest.raises(ApiError) as refused:
            await d.acquire(Tier.P3, "t", "m", "p")
        assert refused.value.status == 503 and refused.value.code == "queue_full"
        assert "retry after" in refused.value.message and "unknown" not in refused.value.message
        assert router.state("only").num_in_flight == 0

    asyncio.run(run())


def _over(
    clock: VirtualClock,
    ups: list[UpstreamConfig],
    models: dict[str, frozenset[str]] | None = None,
    wait_s: float = 10.0,
) -> tuple[Dispatcher, FlowControl]:
    """A dispatcher over healthy `ups` (each listing `models[name]`, else any model)."""
    router = Router(ups, GatewaySettings(), clock)
    for up in ups:
        router.record_success(up.name, (models or {}).get(up.name))
    waits = {t: wait_s for t in ALL_TIERS}
    flow = FlowControl(EngineConfig(), "hybrid", {t: 100 for t in ALL_TIERS}, waits, clock)
    return Dispatcher(router, flow, GatewayMetrics(), clock), flow


def test_a_backlog_for_one_model_holds_no_other_models_requests() -> None:
    """The reviewer's case: one 70B request waiting for a full upstream held every 8B request
    (P0 too, 1.9 s against its 0.5 s target) while the 8B upstream sat idle, until the 70B
    request timed out."""

    async def run() -> None:
        ups = [
            UpstreamConfig("big", "openai", "http://127.0.0.1:1", max_in_flight=1),
            UpstreamConfig("small", "openai", "http://127.0.0.1:2", max_in_flight=4),
        ]
        d, flow = _over(VirtualClock(), ups, {"big": frozenset({"70b"}), "small": frozenset({"8b"})})
        running = await d.acquire(Tier.P1, "t", "70b", "p")
        waiting = asyncio.create_task(d.acquire(Tier.P1, "t", "70b", "p"))
        await asyncio.sleep(0.01)
        assert not waiting.done() and len(flow) == 1
        # Straight through, at any tier: nothing for 8B waits.
        for tier in (Tier.P3, Tier.P0):
            decision = await asyncio.wait_for(d.acquire(tier, "t", "8b", "p"), 1.0)
            assert decision.upstream == "small"
        # 8B's own requests queued while its upstream is full go when it has room again,
        # past the 70B head that still has none.
        held = [await d.acquire(Tier.P2, "t", "8b", "p") for _ in range(2)]
        queued = asyncio.create_task(d.acquire(Tier.P2, "t", "8b", "p"))
        await asyncio.sleep(0.01)
        assert not queued.done() and len(flow) == 2
        d.finished(held[0])
        assert (await asyncio.wait_for(queued, 1.0)).upstream == "small"
        assert not waiting.done()
        d.finished(running)
        assert (await asyncio.wait_for(waiting, 1.0)).upstream == "big"

    asyncio.run(run())


def test_a_retried_request_with_room_only_where_it_failed_holds_nobody_back() -> None:
    """A retried request keeps its place (the wait it has left); at the head, with room only
    on the upstream it failed on, it held every request of its model's tier behind it while
    that upstream had free seats."""

    async def run() -> None:
        clock = VirtualClock()
        ups = [
            UpstreamConfig("u0", "openai", "http://127.0.0.1:1", max_in_flight=4),
            UpstreamConfig("u1", "openai", "http://127.0.0.1:2", max_in_flight=1),
        ]
        d, flow = _over(clock, ups)
        busy = await d.acquire(Tier.P1, "t", "m", "p", exclude=["u0"])
        assert busy.upstream == "u1"  # u1 is full now
        retried = asyncio.create_task(d.acquire(Tier.P1, "t", "m", "p", exclude=["u0"], waited_s=1.0))
        await asyncio.sleep(0.01)
        others = [asyncio.create_task(d.acquire(Tier.P1, "t", "m", "q")) for _ in range(3)]
        await asyncio.sleep(0.01)
        done = await asyncio.wait_for(asyncio.gather(*others), 1.0)
        assert [x.upstream for x in done] == ["u0"] * 3
        assert not retried.done() and len(flow) == 1  # still waiting, in its place
        clock.elapse(2.0)
        d.finished(busy)
        decision = await asyncio.wait_for(retried, 1.0)
        assert decision.upstream == "u1" and decision.waited_s == pytest.approx(2.0, abs=0.05)

    asyncio.run(run())


def test_models_an_upstream_serves_together_share_one_queue_and_its_fairness() -> None:
    """vLLM lists each LoRA adapter as a model: with a queue per model, a light tenant's one
    request for an adapter waited behind a heavy tenant's 50 for the base model (released
    51st, tenant fairness lost across the queues), where one queue released it second."""
    from tierserve.gateway.dispatch_core import ALL_MODELS, model_groups

    llama, chat = frozenset({"llama", "llama-sql"}), frozenset({"llama", "llama-chat"})
    groups = model_groups([("u1", llama), ("u2", llama), ("u3", frozenset({"8b"})), ("u4", chat)])
    # Served by the same upstreams: one group; sharing only some of them, apart (a head of
    # llama-sql with no room held llama-chat back while u4 sat idle).
    assert groups["llama-sql"] == "u1\0u2" and groups["8b"] == "u3" and groups["llama-chat"] == "u4"
    assert groups["llama"] == "u1\0u2\0u4"
    assert model_groups([("u1", frozenset({"8b"})), ("u2", frozenset())]) == {}  # one serves any

    async def run() -> list[str]:
        clock = VirtualClock()
        up = UpstreamConfig("u", "openai", "http://127.0.0.1:1", max_in_flight=1)
        d, _ = _over(clock, [up], {"u": frozenset({"llama", "llama-sql"})}, wait_s=100.0)
        assert d._core.group("llama-sql") == d._core.group("llama") == "u"
        assert d._core.group("other") == "other"
        first = await d.acquire(Tier.P1, "heavy", "llama", "p")
        order: list[str] = []

        async def one(tenant: str, model: str) -> None:
            decision = await d.acquire(Tier.P1, tenant, model, "p")
            order.append(tenant)
            await asyncio.sleep(0)
            d.finished(decision)

        tasks = [asyncio.create_task(one("heavy", "llama")) for _ in range(20)]
        await asyncio.sleep(0.01)
        clock.elapse(0.5)
        tasks.append(asyncio.create_task(one("light", "llama-sql")))
        await asyncio.sleep(0.01)
        d.finished(first)
        await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        return order

    order = asyncio.run(run())
    assert order.index("light") <= 2 and len(order) == 21
    assert ALL_MODELS == "*"


def test_an_upstream_not_yet_admitted_puts_no_two_models_in_one_queue() -> None:
    """An upstream that never passed a check lists no model yet, which read as "serves any":
    every model shared one queue, and a backlog on one held another's requests while that
    model's own upstream sat idle (a review)."""

    async def run() -> bool:
        clock = VirtualClock()
        ups = [
            UpstreamConfig("a", "openai", "http://127.0.0.1:1", max_in_flight=1),
            UpstreamConfig("b", "openai", "http://127.0.0.1:2", max_in_flight=4),
            UpstreamConfig("starting", "openai", "http://127.0.0.1:3"),  # never answers a check
        ]
        router = Router(ups, GatewaySettings(), clock)
        router.record_success("a", frozenset({"ma"}))
        router.record_success("b", frozenset({"mb"}))
        flow = FlowControl(
            EngineConfig(), "hybrid", {t: 100 for t in ALL_TIERS}, {t: 10.0 for t in ALL_TIERS}, clock
        )
        d = Dispatcher(router, flow, GatewayMetrics(), clock)
        busy = await d.acquire(Tier.P1, "t", "ma", "p")
        backlog = [asyncio.create_task(d.acquire(Tier.P1, "t", "ma", "p")) for _ in range(3)]
        await asyncio.sleep(0.01)
        other = await asyncio.wait_for(d.acquire(Tier.P1, "u", "mb", "q"), 1.0)
        assert other.upstream == "b"
        for task in backlog:
            task.cancel()
        await asyncio.gather(*backlog, return_exceptions=True)
        d.finished(busy)
        return True

    assert asyncio.run(run())


def test_a_request_stepping_aside_keeps_its_place_before_its_tenants_younger_ones() -> None:
    """Taken out and added again, it went behind its tenant's younger requests (a review)."""
    from tierserve.gateway.dispatch_core import DispatchCore, Released

    clock = VirtualClock()
    ups = [
        UpstreamConfig(n, "openai", f"http://127.0.0.1:{i + 1}", max_in_flight=1)
        for i, n in enumerate(("u0", "u1"))
    ]
    router = Router(ups, GatewaySettings(), clock)
    for up in ups:
        router.record_success(up.name)
    flow = FlowControl(
        EngineConfig(), "hybrid", {t: 50 for t in ALL_TIERS}, {t: 30.0 for t in ALL_TIERS}, clock
    )
    core: DispatchCore[str] = DispatchCore(router, flow, clock)
    busy0, busy1 = core.route_now(Tier.P1, "x", "m"), core.route_now(Tier.P1, "y", "m")
    assert busy0 is not None and busy1 is not None
    core.enqueue("A", Tier.P1, "t", "m", "p", [busy0.upstream], waited_s=5.0)  # a retry
    clock.elapse(0.1)
    core.enqueue("B", Tier.P1, "t", "m", "p")
    clock.elapse(0.1)
    core.enqueue("C", Tier.P1, "t", "m", "p")
    order = []
    for upstream in (busy0.upstream, busy1.upstream):  # room where A failed, then where it may go
        core.finished(upstream, Tier.P1)
        order += [f"{e.handle}->{e.decision.upstream}" for e in core.pump() if isinstance(e, Released)]
        clock.elapse(0.1)
    assert order == [f"B->{busy0.upstream}", f"A->{busy1.upstream}"]
