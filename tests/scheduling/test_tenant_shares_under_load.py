"""Tenants of one tier under a queue that stays long, in virtual time on the sim executor.

The tenant tests in test_policies.py drain a queue at one instant; here tenant A sends ten
times tenant B's requests, open loop, about three times what the engine serves, and the
shares are read from the admissions while both wait. `hybrid`'s rescue and aging take the
oldest waiting request of the tier across its tenants, so under sustained overload the
tier runs in arrival order and B gets its share of the arrivals, not of the tier (a known
defect: docs/scheduling.md, "Rescued and aged requests"). The test marks it: it fails
the day the fix lands, to be turned into a plain test then.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, SchedulerConfig
from tierserve.engine import Engine
from tierserve.executors.sim import build_sim_executor
from tierserve.request import EventKind, Request, SamplingParams
from tierserve.tiers import Tier

HORIZON_S = 60.0
B_RATE = 1.0  # requests/s; A sends 10 x that


def _b_share(policy: str, tier: Tier) -> float:
    """B's share of the admissions between 20 s and the end."""
    engine = Engine(
        EngineConfig(scheduler=SchedulerConfig(max_num_seqs=16)),
        policy,
        build_sim_executor("llama-3.1-70b", "a100-80gb", tp=8),
        VirtualClock(),
    )
    rng = random.Random(0)
    arrivals: list[tuple[float, str]] = []
    for tenant, rate in (("A", 10 * B_RATE), ("B", B_RATE)):
        t = rng.expovariate(rate)
        while t < HORIZON_S:
            arrivals.append((t, tenant))
            t += rng.expovariate(rate)
    arrivals.sort()
    requests: list[Request] = []
    clock = engine.clock
    i = 0
    while clock.now() < HORIZON_S:
        while i < len(arrivals) and arrivals[i][0] <= clock.now():
            tenant = arrivals[i][1]
            ids = [(len(requests) * 7919 + k * 31) % 50_000 + 1 for k in range(1000)]
            req = Request(
                f"{tenant}-{len(requests)}",
                ids,
                SamplingParams(max_tokens=200),
                tier=tier,
                tenant=tenant,
                arrival_time=clock.now(),
            )
            engine.add_request(req)
            requests.append(req)
            i += 1
        if engine.has_unfinished():
            engine.step()
        elif i < len(arrivals):
            clock.advance_to(arrivals[i][0])
    admitted: Counter[str] = Counter()
    for req in requests:
        at = next((e.time for e in req.events if e.kind is EventKind.ADMITTED), None)
        if at is not None and at >= 20.0:
            admitted[req.tenant] += 1
    assert admitted.total() > 0, "nothing admitted after 20 s"
    return admitted["B"] / admitted.total()


@pytest.mark.parametrize("policy", ["wfq", "drr"])
def test_a_flooding_tenant_does_not_take_another_tenants_share_of_its_tier(policy: str) -> None:
    # B asks for well under half the tier: it gets all it asks for, about a third of the
    # admissions here (it arrives at 1/11 of the requests).
    assert _b_share(policy, Tier.P2) > 0.25


@pytest.mark.xfail(
    strict=True,
    reason="hybrid's rescue and aging serve the tier's oldest requests across tenants "
    "(docs/scheduling.md, 'Rescued and aged requests'): B gets about its share of arrivals",
)
@pytest.mark.parametrize("tier", [Tier.P1, Tier.P2, Tier.P3], ids=["P1", "P2", "P3"])
def test_under_hybrid_too(tier: Tier) -> None:
    assert _b_share("hybrid", tier) > 0.25
