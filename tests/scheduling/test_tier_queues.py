"""Tenant-fair queues: forgetting departed tenants changes no order and bounds the memory."""

from __future__ import annotations

import random

import pytest

from tests.conftest import make_request
from tierserve.request import Request
from tierserve.scheduling import tier_queues
from tierserve.scheduling.tier_queues import TenantFairQueue
from tierserve.tiers import Tier


def _serve(queue: TenantFairQueue, seed: int, rounds: int) -> tuple[list[Request], int]:
    """Tenants arrive with a few requests each, among a few steady ones; returns the order of
    service and the most tenant tags the queue held."""
    rng = random.Random(seed)
    order, most = [], 0
    serial = 0
    for step in range(rounds):
        for _ in range(rng.randint(0, 3)):
            tenant = rng.choice(["steady-a", "steady-b", f"passing-{serial}"])
            req = make_request(
                num_prompt=rng.randint(10, 200),
                max_tokens=10,
                tier=Tier.P1,
                arrival=float(step),
                request_id=f"q{serial}",
            )
            req.tenant, req.tenant_weight = tenant, rng.choice([1.0, 2.0])
            queue.append(req)
            serial += 1
        if queue and rng.random() < 0.8:
            order.append(queue.popleft())
        most = max(most, len(queue._last_finish))
    while queue:
        order.append(queue.popleft())
    return order, most


def test_forgetting_departed_tenants_serves_in_the_same_order_in_bounded_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pruned, most = _serve(TenantFairQueue(), seed=4, rounds=3000)
    monkeypatch.setattr(tier_queues, "PRUNE_AT", 10**9)
    kept, most_unpruned = _serve(TenantFairQueue(), seed=4, rounds=3000)
    assert [r.request_id for r in pruned] == [r.request_id for r in kept]
    assert most_unpruned > 1000 and most <= 4 * tier_queues.PRUNE_AT
