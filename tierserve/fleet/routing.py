"""The routers a fleet can run behind, by name: the gateway's own, and the plain ones.

`tier-aware` is the gateway as it ships: its `Router` (P0 where it starts soonest,
least-loaded with prefix affinity) with its `FlowControl` (tier queues while every
replica is full for a request's tier). The others are the plain routers of
`tierserve.gateway.baseline_routers`: they never hold a request back, so the same flow
control stays empty behind them.
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
    kinds: dict[str, type[Router]] = {
        "round-robin": RoundRobinRouter,
        "least-loaded": LeastLoadedRouter,
        "prefix-affinity": PrefixAffinityRouter,
        "tier-aware": Router,
    }
    if name not in kinds:
        raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
    flow = FlowControl(
        EngineConfig(), settings.policy, {t: QUEUE_CAP for t in ALL_TIERS}, settings.max_wait_s, clock
    )
    return FleetDispatch(kinds[name](upstreams(num_upstreams), settings, clock), flow, clock)
