"""The fleet's dispatch is the gateway's: saturation per tier holds back only the tiers it should."""

from __future__ import annotations

from tierserve.clock import VirtualClock
from tierserve.fleet.dispatch import FleetDispatch
from tierserve.fleet.routing import build_dispatch, replica_name, replica_upstream
from tierserve.gateway.config import GatewaySettings
from tierserve.gateway.saturation import LoadSample
from tierserve.tiers import Tier


def _fleet(by_tier: list[tuple[float, ...]]) -> tuple[FleetDispatch, VirtualClock]:
    clock = VirtualClock()
    dispatch = build_dispatch("tier-aware", GatewaySettings(max_waiting=4), clock)
    for i, waiting in enumerate(by_tier):
        dispatch.router.add_upstream(replica_upstream(replica_name(i)))
        dispatch.router.record_success(replica_name(i))
        dispatch.router.record_sample(
            replica_name(i), LoadSample(sum(waiting), 16, 0.6, clock.now(), waiting)
        )
    return dispatch, clock


def test_a_p0_is_routed_at_once_to_the_replica_it_starts_soonest_on_while_p3_waits() -> None:
    dispatch, _ = _fleet([(1, 2, 3, 5), (0, 3, 3, 5), (2, 0, 0, 9)])
    queued = dispatch.submit(0, Tier.P3, "a")
    assert queued.queued and not queued.routed and dispatch.depth(Tier.P3) == 1
    p0 = dispatch.submit(1, Tier.P0, "b")
    assert p0.routed == [(1, replica_name(1))] and not p0.queued
    assert dispatch.num_routed_by_reason == {"p0_soonest": 1}


def test_a_request_queues_behind_waiting_requests_of_its_own_tier_and_leaves_in_order() -> None:
    dispatch, clock = _fleet([(0, 4, 0, 0)])
    assert dispatch.submit(0, Tier.P1, "a").queued
    dispatch.router.record_sample(replica_name(0), LoadSample(0, 16, 0.6, clock.now(), (0, 0, 0, 0)))
    second = dispatch.submit(1, Tier.P1, "b")  # takes a ticket behind the first, then both leave
    assert second.queued and second.routed == [(0, replica_name(0)), (1, replica_name(0))]
    assert dispatch.depth() == 0
