"""The routers a fleet can run behind, by name: the gateway's own, and the plain ones.

`tier-aware` is the gateway as it ships: its `Router` (P0 where it starts soonest,
least-loaded with prefix affinity) with its `FlowControl` (tier queues while every
replica is saturated). The others are the plain routers of
`tierserve.gateway.baseline_routers`, with no flow control.
"""

from __future__ import annotations

from tierserve.clock import Clock
from tierserve.config import EngineConfig
from tierserve.fleet.dispatch import FleetDispatch
from tierserve.gateway.baseline_routers import LeastLoadedRouter, PrefixAffinityRouter, RoundRobinRouter
from tierserve.gateway.config import GatewaySettings, UpstreamConfig
from tierserve.gateway.flow import FlowControl
from tierserve.gateway.router import Router
from tierserve.tiers import ALL_TIERS

ROUTERS = ("round-robin", "least-loaded", "prefix-affinity", "tier-aware")
QUEUE_CAP = 10_000  # per tier: the gateway's queues are bounded by their wait caps, not by length


def replica_name(i: int) -> str:
    return f"replica-{i}"


def upstreams(num: int) -> list[UpstreamConfig]:
    """Every replica the fleet may ever run; each is a candidate only while healthy."""
    return [UpstreamConfig(replica_name(i), "tierserve", f"http://sim/{replica_name(i)}") for i in range(num)]


def build_dispatch(name: str, num_upstreams: int, settings: GatewaySettings, clock: Clock) -> FleetDispatch:
    ups = upstreams(num_upstreams)
    if name == "tier-aware":
        flow = FlowControl(
            EngineConfig(),
            settings.policy,
            {t: QUEUE_CAP for t in ALL_TIERS},
            settings.max_wait_s,
            clock,
        )
        return FleetDispatch(Router(ups, settings, clock), flow, clock)
    plain: dict[str, type[Router]] = {
        "round-robin": RoundRobinRouter,
        "least-loaded": LeastLoadedRouter,
        "prefix-affinity": PrefixAffinityRouter,
    }
    if name not in plain:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    return FleetDispatch(plain[name](ups, settings, clock), None, clock)
