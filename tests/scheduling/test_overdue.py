"""The overdue requests of a tier by tenant (`overdue.py`): what hybrid's rescue and aging
serve, in the tier's tenant-fair order, checked against a direct reading of the rule."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from tests.conftest import make_request
from tierserve.config import EngineConfig
from tierserve.request import Request, SamplingParams
from tierserve.scheduling import create_policy
from tierserve.scheduling.overdue import OverdueByTenant
from tierserve.tiers import Tier


def _request(tenant: str, arrival: float, serial: int = 0) -> Request:
    req = make_request(tier=Tier.P1, arrival=arrival, request_id=f"{tenant}{serial}-{arrival}")
    req.tenant = tenant
    return req


def test_a_request_is_overdue_inside_its_window_only() -> None:
    overdue = OverdueByTenant(after_s=1.0, until_s=5.0)
    req = _request("a", 10.0)
    overdue.add(req)
    tags = {"a": 0.0}.__getitem__
    assert overdue.pick(10.5, tags) is None, "not waited long enough"
    assert overdue.pick(11.0, tags) is None, "over after_s, not at it"
    assert overdue.pick(11.5, tags) is req
    assert overdue.pick(15.0, tags) is None, "at until_s it can no longer be saved"
    assert len(overdue) == 0, "a request past its window is let go"


def test_the_tenant_first_by_start_tag_gives_its_oldest_overdue_request() -> None:
    overdue = OverdueByTenant(after_s=1.0)
    a_old, a_young, b = _request("a", 0.0), _request("a", 1.0), _request("b", 2.0)
    for req in (a_young, b, a_old):
        overdue.add(req)
    tags = {"a": 5.0, "b": 3.0}
    assert overdue.pick(10.0, tags.__getitem__) is b, "b's turn comes first, though a's is older"
    overdue.discard(b)
    assert overdue.pick(10.0, tags.__getitem__) is a_old
    tags["a"] = 6.0  # a was served: its tag moved on (its entry is found behind it)
    overdue.discard(a_old)
    assert overdue.pick(10.0, tags.__getitem__) is a_young


def test_equal_start_tags_go_to_the_older_request() -> None:
    overdue = OverdueByTenant(after_s=0.0)
    b, a = _request("b", 1.0), _request("a", 2.0)
    overdue.add(a)
    overdue.add(b)
    assert overdue.pick(3.0, {"a": 0.0, "b": 0.0}.__getitem__) is b


def test_a_request_put_back_older_than_its_tenants_overdue_ones_goes_first() -> None:
    overdue = OverdueByTenant(after_s=1.0)
    old, young, other = _request("a", 0.0), _request("a", 5.0), _request("b", 3.0)
    tags = {"a": 1.0, "b": 1.0}.__getitem__  # a tie: the older request decides
    for req in (old, young, other):
        overdue.add(req)
    assert overdue.pick(10.0, tags) is old
    overdue.discard(old)  # admitted ...
    assert overdue.pick(10.0, tags) is other
    overdue.add(old)  # ... and preempted: it waits again, older than the rest
    assert overdue.pick(10.0, tags) is old


def test_matches_the_rule_read_directly_over_random_operations() -> None:
    rng = random.Random(7)
    after, until = 2.0, 8.0
    overdue = OverdueByTenant(after, until)
    tenants = [f"t{k}" for k in range(6)]
    tags = dict.fromkeys(tenants, 0.0)
    live: set[Request] = set()
    now, serial = 0.0, 0
    for _ in range(4000):
        now += rng.expovariate(4.0)
        op = rng.random()
        if op < 0.45:
            serial += 1
            req = _request(rng.choice(tenants), now - rng.uniform(0.0, 1.0), serial)
            overdue.add(req)
            live.add(req)
        elif op < 0.55 and live:  # removed (aborted, or served in the fair order)
            req = rng.choice(sorted(live, key=lambda r: r.request_id))
            overdue.discard(req)
            live.discard(req)
        elif op < 0.6 and live:  # a served request put back (preempted)
            req = rng.choice(sorted(live, key=lambda r: r.request_id))
            overdue.discard(req)
            overdue.add(req)
        got = overdue.pick(now, tags.__getitem__)
        window = [r for r in live if after < now - r.arrival_time < until]
        if not window:
            assert got is None
            continue
        expected = min(window, key=lambda r: (tags[r.tenant], r.arrival_time))
        assert got is expected
        if rng.random() < 0.7:  # served: charged to its tenant, whose tag grows
            overdue.discard(got)
            live.discard(got)
            tags[got.tenant] += rng.choice((0.5, 1.0, 2.0))  # few values: ties happen
        for tenant in tenants:  # an idle tenant starts again from another tag
            if not any(r.tenant == tenant for r in live):
                tags[tenant] = float(rng.randrange(20))
    assert sum(overdue.heap_sizes()) < 4 * len(overdue) + 300, "stale entries are dropped"


@pytest.mark.parametrize("until_s", [math.inf, 50.0])
def test_state_stays_bounded_while_an_old_request_holds_the_tops(until_s: float) -> None:
    overdue = OverdueByTenant(after_s=1.0, until_s=until_s)
    old = _request("a", 0.0)
    overdue.add(old)
    tags = {"a": 0.0, "b": 1.0}.__getitem__
    for i in range(5000):  # requests of both tenants come, go overdue and are served
        req = _request("ab"[i % 2], 1.0 + i * 0.01, i)
        overdue.add(req)
        overdue.pick(3.0 + i * 0.01, tags)
        overdue.discard(req)
    assert overdue.pick(60.0, tags) is (old if until_s == math.inf else None)
    assert max(overdue.heap_sizes()) < 200, overdue.heap_sizes()


def test_a_tenant_not_served_for_starve_s_goes_first() -> None:
    overdue = OverdueByTenant(after_s=1.0, starve_s=5.0)
    a1, a2, b1, b2 = _request("a", 0.0), _request("a", 0.5), _request("b", 3.0), _request("b", 8.0)
    tags = {"a": 9.0, "b": 0.0}.__getitem__  # b's turn always comes first
    overdue.add(a1)
    overdue.add(a2)
    assert overdue.pick(2.0, tags) is a1  # a has overdue requests from 2 s
    overdue.add(b1)
    assert overdue.pick(6.0, tags) is b1
    overdue.discard(b1)
    overdue.served(b1, 6.0)
    assert overdue.pick(7.5, tags) is a1, "a not served for over 5 s"
    overdue.discard(a1)
    overdue.served(a1, 7.5)  # a2 keeps a listed, held back from 7.5 s
    overdue.add(b2)
    assert overdue.pick(12.0, tags) is b2
    assert overdue.pick(12.6, tags) is a2


def _p3(request_id: str, tenant: str, arrival: float, tier: Tier = Tier.P3) -> Request:
    return Request(
        request_id, [1] * 100, SamplingParams(max_tokens=100), tier=tier, tenant=tenant, arrival_time=arrival
    )


def test_hybrid_aging_overtakes_no_older_more_urgent_request_for_a_tenant_s_turn() -> None:
    # P3 ages after 5 s (default). Tenant a was served once, so its start tag is past b's;
    # b's P3 request is aged but younger than the P2 and P1 requests waiting: a's older
    # one goes (the tier's oldest, older than both), then P1, P2, and b's last.
    policy = create_policy("hybrid", EngineConfig())
    a1, a2 = _p3("a1", "a", 0.0), _p3("a2", "a", 1.0)
    policy.add(a1, 0.0)
    policy.add(a2, 1.0)
    assert policy.pop(1.0) is a1
    p2, p1, b = _p3("x", "x", 30.0, Tier.P2), _p3("y", "y", 40.0, Tier.P1), _p3("b", "b", 50.0)
    for req in (p2, p1, b):
        policy.add(req, req.arrival_time)
    assert [policy.pop(60.0) for _ in range(4)] == [a2, p1, p2, b]


def test_hybrid_aging_lets_no_stream_of_new_tenants_hold_a_tenant_back_for_good() -> None:
    # Only P3 waits. One-shot tenants (a new id per request) come at 2 requests/s and one
    # request is served a second: each new tenant starts at the virtual time, ahead of a
    # tenant served before, so fair queuing alone never serves that tenant's next request
    # (under `wfq` it still waits after 600 s).
    policy = create_policy("hybrid", EngineConfig())
    a1, a2 = _p3("a1", "a", 0.0), _p3("a2", "a", 20.0)
    policy.add(a1, 0.0)
    events = [(0.2 + 0.5 * k, 1, k) for k in range(1200)] + [(1.0 + s, 2, s) for s in range(600)]
    events.append((20.0, 0, 0))
    served_at = None
    for t, kind, k in sorted(events):
        if kind == 0:
            policy.add(a2, t)
        elif kind == 1:
            policy.add(_p3(f"c{k}", f"c{k}", t), t)
        elif policy.pop(t) is a2:
            served_at = t
    assert served_at is not None and served_at < 120.0, served_at


def _release(policy_name: str, tenants: list[tuple[str, Tier, float, float]], rate: float) -> Counter[str]:
    """Open-loop Poisson arrivals (tenant, tier, requests/s, weight) for 600 s, the queue
    released at `rate` (peek and pop, as the gateway does, with no engine pass): the
    releases of each tenant after 200 s."""
    policy = create_policy(policy_name, EngineConfig())
    rng = random.Random(0)
    events: list[tuple[float, int, int]] = []
    for k, (_, _, per_s, _) in enumerate(tenants):
        t = rng.expovariate(per_s)
        while t < 600.0:
            events.append((t, 0, k))
            t += rng.expovariate(per_s)
    events += [((i + 1) / rate, 1, -1) for i in range(int(600.0 * rate) - 1)]
    released: Counter[str] = Counter()
    for n, (t, kind, k) in enumerate(sorted(events)):
        if kind == 0:
            tenant, tier, _, weight = tenants[k]
            req = Request(f"r{n}", [1] * 1000, SamplingParams(max_tokens=200), tier=tier, tenant=tenant)
            req.tenant_weight = weight
            policy.add(req, t)
        elif len(policy):
            peeked = policy.peek(t)
            req = policy.pop(t)
            assert peeked is req
            if t >= 200.0:
                released[req.tenant] += 1
    return released


def test_weights_decide_between_many_tenants_of_an_aged_tier() -> None:
    # 20 P3 tenants, weights 1-4 (five of each), twice what is released: the held-back
    # backstop stays a backstop (at 5 s, P3's aging, it served each tenant in turn: 25 %
    # a weight).
    tenants = [(f"w{w}-{k}", Tier.P3, 0.2, float(w)) for w in range(1, 5) for k in range(5)]
    released = _release("hybrid", tenants, rate=2.0)
    total = released.total()
    for w in range(1, 5):
        share = sum(n for tenant, n in released.items() if tenant.startswith(f"w{w}-")) / total
        assert abs(share - w / 10) < 0.04, (w, share, dict(released))
