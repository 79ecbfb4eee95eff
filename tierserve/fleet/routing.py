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


def replica_upstream(name: str) -> UpstreamConfig:
    """A launched replica as the gateway knows it (added when it launches; a candidate only
    while healthy)."""
    return UpstreamConfig(name, "tierserve", f"http://sim/{name}")


def build_dispatch(name: str, settings: GatewaySettings, clock: Clock) -> FleetDispatch:
    """The named router, knowing no upstream yet, behind the gateway's flow control."""
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
    return FleetDispatch(kinds[name]([], settings, clock), flow, clock)
