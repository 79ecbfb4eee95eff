"""The plain routers the fleet bench compares against: no tiers, no saturation, no queue."""

from __future__ import annotations

from tierserve.clock import VirtualClock
from tierserve.gateway.baseline_routers import LeastLoadedRouter, PrefixAffinityRouter, RoundRobinRouter
from tierserve.gateway.config import GatewaySettings, UpstreamConfig
from tierserve.gateway.router import Router
from tierserve.gateway.saturation import LoadSample
from tierserve.tiers import Tier

M = "m"


def _make(cls: type[Router], n: int = 3) -> tuple[Router, VirtualClock]:
    clock = VirtualClock(10.0)
    ups = [UpstreamConfig(f"u{i}", "tierserve", f"http://127.0.0.1:{9100 + i}") for i in range(n)]
    router = cls(ups, GatewaySettings(), clock)
    for u in ups:
        router.record_success(u.name)
        router.record_sample(u.name, LoadSample(0, 0, 0.0, clock.now()))
    return router, clock


def _pick(router: Router, prefix: str = "p", tier: Tier = Tier.P1) -> str:
    decision = router.route(tier, prefix, M)
    assert decision is not None
    return decision.upstream


def test_round_robin_cycles_over_healthy_replicas_only() -> None:
    router, _ = _make(RoundRobinRouter)
    assert [_pick(router) for _ in range(6)] == ["u0", "u1", "u2", "u0", "u1", "u2"]
    router.record_failure("u1", eject_now=True)
    assert set(_pick(router) for _ in range(4)) == {"u0", "u2"}


def test_least_loaded_takes_the_lowest_load_even_when_all_are_saturated() -> None:
    router, clock = _make(LeastLoadedRouter)
    for name, waiting in (("u0", 50), ("u1", 20), ("u2", 80)):
        router.record_sample(name, LoadSample(waiting, 10, 0.99, clock.now()))
    assert all(router.saturated(s, Tier.P0) for s in router.states)
    assert _pick(router, tier=Tier.P0) == "u1"
    clock.elapse(100.0)  # stale metrics hold nothing back either
    assert _pick(router) == "u1"


def test_prefix_affinity_sticks_within_the_bound_and_spills_past_it() -> None:
    router, clock = _make(PrefixAffinityRouter)
    home = _pick(router, "system prompt A")
    assert {_pick(router, "system prompt A") for _ in range(5)} == {home}
    router.record_sample(home, LoadSample(30, 30, 0.5, clock.now()))
    assert _pick(router, "system prompt A") != home


def test_no_candidate_left_means_no_route() -> None:
    for cls in (RoundRobinRouter, LeastLoadedRouter, PrefixAffinityRouter):
        router, _ = _make(cls, n=1)
        router.record_failure("u0", eject_now=True)
        assert router.route(Tier.P1, "p", M) is None
