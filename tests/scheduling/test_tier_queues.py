"""Tenant-fair queues: bounded state for any pattern of tenant ids, O(log n) work per pop."""

from __future__ import annotations

import random

import pytest

from tests.conftest import make_request
from tierserve.request import Request
from tierserve.scheduling import fair_queue
from tierserve.scheduling.oldest import OldestWaiting
from tierserve.scheduling.tier_queues import TenantFairQueue
from tierserve.tiers import Tier


def _request(tenant: str, serial: int, arrival: float, prompt: int, weight: float = 1.0) -> Request:
    req = make_request(
        num_prompt=prompt, max_tokens=10, tier=Tier.P1, arrival=arrival, request_id=f"q{serial}"
    )
    req.tenant, req.tenant_weight = tenant, weight
    return req


def _serve(queue: TenantFairQueue, seed: int, rounds: int) -> tuple[list[str], int]:
    """Tenants arrive with a few requests each, among a few steady ones; returns the order of
    service and the most tenant tags the queue held."""
    rng = random.Random(seed)
    order, most, serial = [], 0, 0
    for step in range(rounds):
        for _ in range(rng.randint(0, 3)):
            tenant = rng.choice(["steady-a", "steady-b", f"passing-{serial}"])
            queue.append(_request(tenant, serial, float(step), rng.randint(10, 200), rng.choice([1.0, 2.0])))
            serial += 1
        if queue and rng.random() < 0.8:
            order.append(queue.popleft().request_id)
        most = max(most, queue.num_tags())
    while queue:
        order.append(queue.popleft().request_id)
    return order, most


def test_bounding_the_tags_leaves_the_order_of_a_mixed_workload_unchanged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bounded, most = _serve(TenantFairQueue(), seed=4, rounds=3000)
    monkeypatch.setattr(fair_queue, "IDLE_TAGS_FLOOR", 10**9)
    unbounded, _ = _serve(TenantFairQueue(), seed=4, rounds=3000)
    assert bounded == unbounded
    assert most <= 2 * fair_queue.IDLE_TAGS_FLOOR


def _one_off_tenants(queue: TenantFairQueue, num_tenants: int) -> tuple[list[int], list[int]]:
    """A steady tenant keeps a backlog; every other request comes from a tenant never seen
    again (issue 14's soak). Returns the tags held and the heap operations of each pop."""
    tags, ops = [], []
    steady = 0
    for i in range(num_tenants):
        while len(queue) < 8:  # the steady tenant's backlog
            queue.append(_request("steady", -1 - steady, float(i), 100))
            steady += 1
        queue.append(_request(f"one-off-{i}", i, float(i), 50))
        before = queue.ops
        queue.popleft()
        ops.append(queue.ops - before)
        tags.append(queue.num_tags())
    return tags, ops


def test_fifty_thousand_one_off_tenants_leave_flat_state_and_constant_work_per_pop() -> None:
    n = 50_000
    tags, ops = _one_off_tenants(TenantFairQueue(), n)
    bound = fair_queue.IDLE_TAGS_FLOOR + 20
    assert max(tags) <= bound, "tags grew with the number of tenants ever seen"
    assert max(tags[-1000:]) <= max(tags[:5000]) + 1, "tags are not flat"
    first, last = ops[1000:6000], ops[-5000:]
    assert sum(last) / len(last) <= 1.2 * sum(first) / len(first) + 1, "work per pop grows"
    assert sum(last) / len(last) < 20


def test_without_the_cap_one_off_tenants_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # The case the cap exists for: a new tenant starts at V, so V never passes its tag.
    monkeypatch.setattr(fair_queue, "IDLE_TAGS_FLOOR", 10**9)
    tags, _ = _one_off_tenants(TenantFairQueue(), 5000)
    assert tags[-1] > 1000


def test_taking_a_request_out_of_order_charges_its_tenant() -> None:
    # A rescue serves a chosen request, not the fair head; it still uses up its tenant's
    # share, so the next request in fair order is the other tenant's.
    queue = TenantFairQueue()
    a1, a2 = _request("a", 1, 0.0, 100), _request("a", 2, 0.0, 100)
    b1 = _request("b", 3, 1.0, 100)
    for req in (a1, a2, b1):
        queue.append(req)
    queue.take(a2)
    assert len(queue) == 2
    assert queue.popleft() is b1, "a was charged for a2: b goes next"
    assert queue.popleft() is a1 and not queue


def test_the_oldest_waiting_request_survives_serving_and_putting_back() -> None:
    waiting = OldestWaiting()
    old, young = make_request(tier=Tier.P1, arrival=1.0), make_request(tier=Tier.P1, arrival=2.0)
    waiting.add(young)
    waiting.add(old)
    assert waiting.oldest(Tier.P1) is old and waiting.oldest(Tier.P2) is None
    waiting.discard(old)  # served
    assert waiting.oldest(Tier.P1) is young
    waiting.add(old)  # preempted and put back: it waits again
    assert waiting.oldest(Tier.P1) is old
    assert waiting.oldest(Tier.P1, arrived_after=1.5) is young, "older ones are past the bound"


def test_the_oldest_waiting_heap_stays_bounded_while_an_old_request_holds_its_top() -> None:
    waiting = OldestWaiting()
    old = make_request(tier=Tier.P1, arrival=0.0)
    waiting.add(old)
    for i in range(5000):  # served young requests stay behind the old one in the heap
        req = make_request(tier=Tier.P1, arrival=1.0 + i)
        waiting.add(req)
        waiting.discard(req)
    assert waiting.oldest(Tier.P1) is old
    assert waiting.heap_size(Tier.P1) < 100, "stale entries are dropped, not 5,000 kept"


def test_a_waiting_heap_by_another_key_walks_its_smallest_as_far_as_asked() -> None:
    waiting = OldestWaiting(key=lambda r: r.num_prompt_tokens)
    sizes = [700, 100, 400, 300, 900]
    reqs = [make_request(num_prompt=n, tier=Tier.P0) for n in sizes]
    for r in reqs:
        waiting.add(r)
    waiting.discard(reqs[3])  # the 300 left the queue
    total = 0

    def enough(req: object) -> bool:
        nonlocal total
        total += req.num_prompt_tokens  # type: ignore[attr-defined]
        return total >= 500

    assert [r.num_prompt_tokens for r in waiting.first(Tier.P0, enough)] == [100, 400]
    assert waiting.oldest(Tier.P0) is reqs[1], "the walk leaves the heap as it was"
    assert [r.num_prompt_tokens for r in waiting.first(Tier.P0, lambda r: False)] == [100, 400, 700, 900]
