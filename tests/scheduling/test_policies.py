"""Queue-order behaviour of each policy, driven directly (no engine)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.conftest import make_request
from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling import POLICIES, create_policy
from tierserve.scheduling.base import Policy
from tierserve.scheduling.step import StepBudget
from tierserve.tiers import ALL_TIERS, Tier


def backlog(policy: Policy, per_tier: int, *, prompt: int = 100, out: int = 50) -> None:
    for i in range(per_tier):
        for tier in ALL_TIERS:
            policy.add(make_request(num_prompt=prompt, max_tokens=out, tier=tier, arrival=i * 1e-3), 0.0)


def drain(policy: Policy, n: int, now: float = 0.0) -> list[Request]:
    served = []
    for _ in range(n):
        peeked = policy.peek(now)
        popped = policy.pop(now)
        assert popped is peeked, "pop must return what peek showed"
        served.append(popped)
    return served


def test_unknown_policy_names_the_choices() -> None:
    with pytest.raises(ValueError, match="hybrid"):
        create_policy("lottery", EngineConfig())


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_serves_every_request_once(name: str) -> None:
    policy = create_policy(name, EngineConfig())
    backlog(policy, 25)
    assert len(policy) == 100
    served = drain(policy, 100)
    assert len({id(r) for r in served}) == 100
    assert policy.peek(0.0) is None and len(policy) == 0


def test_fcfs_ignores_tiers() -> None:
    policy = create_policy("fcfs", EngineConfig())
    reqs = [make_request(tier=t, arrival=i) for i, t in enumerate([Tier.P3, Tier.P0, Tier.P2])]
    for r in reqs:
        policy.add(r, 0.0)
    assert drain(policy, 3) == reqs


def test_strict_starves_a_backlogged_p3() -> None:
    policy = create_policy("strict", EngineConfig())
    p3 = make_request(tier=Tier.P3)
    policy.add(p3, 0.0)
    for step in range(1000):
        policy.add(make_request(tier=Tier.P1, arrival=step), float(step))
        assert policy.pop(float(step)).tier is Tier.P1
    assert p3 in list(policy)


def test_wfq_service_shares_converge_to_the_weights() -> None:
    config = EngineConfig()
    policy = create_policy("wfq", config)
    backlog(policy, 3000)
    cost: Counter[Tier] = Counter()
    for req in drain(policy, 4000):
        cost[req.tier] += req.expected_cost_tokens
    weights = {t: config.tiers[t].wfq_weight for t in ALL_TIERS}
    total_w, total_c = sum(weights.values()), sum(cost.values())
    for tier in ALL_TIERS:
        share, target = cost[tier] / total_c, weights[tier] / total_w
        assert share == pytest.approx(target, rel=0.05), (tier, share, target)


def test_wfq_charges_cost_not_request_count() -> None:
    """A tier of long requests gets fewer requests through, the same tokens per weight."""
    policy = create_policy("wfq", EngineConfig())
    for i in range(2000):
        policy.add(make_request(num_prompt=1000, max_tokens=1, tier=Tier.P1, arrival=i), 0.0)
        policy.add(make_request(num_prompt=100, max_tokens=1, tier=Tier.P2, arrival=i), 0.0)
    served = Counter(r.tier for r in drain(policy, 1200))
    # Weights 8:4 with costs 1001:101 -> P2 gets about 5x as many requests as P1.
    assert served[Tier.P2] / served[Tier.P1] == pytest.approx((4 / 101) / (8 / 1001), rel=0.05)


def test_wfq_does_not_let_an_idle_tier_bank_credit() -> None:
    policy = create_policy("wfq", EngineConfig())
    for i in range(500):
        policy.add(make_request(tier=Tier.P2, arrival=i), 0.0)
    drain(policy, 400)  # P1 idle all this time
    for i in range(100):
        policy.add(make_request(tier=Tier.P1, arrival=1000 + i), 0.0)
    first = Counter(r.tier for r in drain(policy, 30))
    assert first[Tier.P2] > 0, "P1 must not monopolise the link with banked credit"


def test_drr_counts_requests_by_weight() -> None:
    policy = create_policy("drr", EngineConfig())
    backlog(policy, 1000)
    served = Counter(r.tier for r in drain(policy, 1500))
    assert [served[t] for t in ALL_TIERS] == [800, 400, 200, 100]


def test_token_drr_counts_tokens_by_weight() -> None:
    config = EngineConfig()
    policy = create_policy("drr-tokens", config)
    for i in range(3000):
        for tier, prompt in zip(ALL_TIERS, (500, 100, 2000, 300), strict=True):
            policy.add(make_request(num_prompt=prompt, max_tokens=1, tier=tier, arrival=i), 0.0)
    cost: Counter[Tier] = Counter()
    for req in drain(policy, 3000):
        cost[req.tier] += req.expected_cost_tokens
    total = sum(cost.values())
    for tier in ALL_TIERS:
        assert cost[tier] / total == pytest.approx(config.tiers[tier].drr_weight / 15, rel=0.05)


def test_hybrid_serves_p0_first_and_p3_only_when_p1_is_empty() -> None:
    policy = create_policy("hybrid", EngineConfig())
    p3 = make_request(tier=Tier.P3, arrival=0.0)
    p1s = [make_request(tier=Tier.P1, arrival=0.1 + i) for i in range(3)]
    p0 = make_request(tier=Tier.P0, arrival=5.0)
    for r in [p3, *p1s, p0]:
        policy.add(r, 0.0)
    now = 1.0  # nobody has aged yet (P3 ages after 5 s)
    assert drain(policy, 4, now) == [p0, *p1s]
    assert drain(policy, 1, now) == [p3]


def test_hybrid_aging_is_evaluated_while_requests_wait() -> None:
    config = EngineConfig()
    policy = create_policy("hybrid", config)
    p3 = make_request(tier=Tier.P3, arrival=0.0)
    policy.add(p3, 0.0)
    aging = config.tiers[Tier.P3].aging_s
    for i in range(50):  # recent P1 arrivals: none is at risk of its target yet
        policy.add(make_request(tier=Tier.P1, arrival=aging - 1.0 + 0.01 * i), 0.0)
    assert policy.peek(aging - 0.1).tier is Tier.P1
    # Nothing was re-enqueued: the same queue, a later pass, and P3 is now first.
    assert policy.peek(aging + 0.1) is p3
    assert p3.tier is Tier.P3, "aging reorders; it never changes the entitled tier"


def test_hybrid_p3_steps_aside_only_while_a_p2_request_is_in_danger() -> None:
    policy = create_policy("hybrid", EngineConfig())
    p3 = make_request(tier=Tier.P3, arrival=0.0)  # aged after 5 s
    p2 = make_request(tier=Tier.P2, arrival=1.0)  # target 60 s: in danger after 30 s, lost after 60 s
    policy.add(p3, 0.0)
    policy.add(p2, 1.0)
    swapped_p3 = make_request(tier=Tier.P3, arrival=0.0)

    def at(now: float) -> Request | None:
        policy.begin_step(StepBudget(2048, 256), [], now)  # the pass judges the danger
        return policy.peek(now)

    assert at(20.0) is p3, "P2 has waited 19 s: the aged, older P3 goes first"
    assert policy.may_swap_in(swapped_p3)
    assert at(40.0) is p2, "P2 has waited 39 s of its 60: P3 steps aside, aged or not"
    assert not policy.may_swap_in(swapped_p3) and not policy.returns_first(swapped_p3, p2)
    assert at(70.0) is p3, "P2 has missed its target: going first no longer saves it"
    assert policy.may_swap_in(swapped_p3)


def test_hybrid_p0_still_beats_an_aged_request() -> None:
    policy = create_policy("hybrid", EngineConfig())
    old = make_request(tier=Tier.P2, arrival=0.0)
    p0 = make_request(tier=Tier.P0, arrival=100.0)
    policy.add(old, 0.0)
    policy.add(p0, 100.0)
    assert policy.peek(100.0) is p0


def test_vllm_priority_orders_by_priority_then_arrival_without_aging() -> None:
    policy = create_policy("vllm-priority", EngineConfig())
    late_p0 = make_request(tier=Tier.P0, arrival=9.0)
    early_p2 = make_request(tier=Tier.P2, arrival=1.0)
    early_p3 = make_request(tier=Tier.P3, arrival=0.0)
    for r in (early_p3, early_p2, late_p0):
        policy.add(r, 0.0)
    assert drain(policy, 3, now=1e6) == [late_p0, early_p2, early_p3]


def test_removed_requests_never_come_out() -> None:
    for name in POLICIES:
        policy = create_policy(name, EngineConfig())
        reqs = [make_request(tier=t, arrival=i) for i, t in enumerate(ALL_TIERS)]
        for r in reqs:
            policy.add(r, 0.0)
        policy.remove(reqs[0])
        policy.remove(reqs[2])
        served = drain(policy, 2)
        assert set(map(id, served)) == {id(reqs[1]), id(reqs[3])}, name
        assert policy.num_waiting() == 0


def test_hybrid_aging_never_lets_a_request_overtake_an_older_more_urgent_one() -> None:
    policy = create_policy("hybrid", EngineConfig())
    old_p1 = make_request(tier=Tier.P1, arrival=0.0)
    aged_p3 = make_request(tier=Tier.P3, arrival=1.0)
    policy.add(old_p1, 0.0)
    policy.add(aged_p3, 1.0)
    # At t = 20 both waited long; P3's 5 s threshold is passed, P1's 30 s is not, but the
    # P1 request is older: it goes first.
    assert policy.peek(20.0) is old_p1
    policy.pop(20.0)
    assert policy.peek(20.0) is aged_p3


def test_hybrid_serves_p1_before_p2_whatever_their_weights() -> None:
    # Under overload the loss falls on P2 before P1 (issue 13): by weight, fifty cheap P2
    # requests would go ahead of an expensive P1 one (wfq does that); hybrid serves P1 first.
    config = EngineConfig()
    for name, first_tier in (("wfq", Tier.P2), ("hybrid", Tier.P1)):
        policy = create_policy(name, config)
        for _ in range(2):
            policy.add(make_request(num_prompt=5000, max_tokens=500, tier=Tier.P1, arrival=0.0), 0.0)
        for _ in range(50):
            policy.add(make_request(num_prompt=10, max_tokens=1, tier=Tier.P2, arrival=0.0), 0.0)
        drain(policy, 1, now=0.0)
        assert policy.peek(0.5).tier is first_tier, name


def test_hybrid_serves_p1_at_risk_before_p2_at_risk_whatever_their_deadlines() -> None:
    # Under overload the loss falls on P2 before P1 (issue 13): no earliest-deadline tie.
    policy = create_policy("hybrid", EngineConfig())
    p2 = make_request(tier=Tier.P2, arrival=0.0)  # due at 60 s
    p1 = make_request(tier=Tier.P1, arrival=57.0)  # due at 62 s
    policy.add(p2, 0.0)
    policy.add(p1, 57.0)
    assert policy.peek(59.6) is p1


def test_hybrid_serves_p1_at_risk_before_an_aged_p3() -> None:
    policy = create_policy("hybrid", EngineConfig())
    p3 = make_request(tier=Tier.P3, arrival=0.0)  # aged after 5 s
    p1 = make_request(tier=Tier.P1, arrival=4.5)  # at risk after 1.25 s (a quarter of 5 s)
    policy.add(p3, 0.0)
    policy.add(p1, 4.5)
    assert policy.peek(5.5) is p3, "aged, and older than the P1 request: served ahead of the fair order"
    assert policy.peek(6.0) is p1, "but a P1 past a quarter of its target goes first"


@pytest.mark.parametrize("name", ["strict", "wfq", "hybrid", "drr"])
def test_tenants_of_one_tier_share_it_by_their_weights(name: str) -> None:
    policy = create_policy(name, EngineConfig())
    for i in range(400):
        for tenant, weight in (("big", 3.0), ("small", 1.0)):
            req = make_request(num_prompt=100, max_tokens=10, tier=Tier.P1, arrival=float(i))
            req.tenant, req.tenant_weight = tenant, weight
            policy.add(req, 0.0)
    served = Counter(r.tenant for r in drain(policy, 400))
    assert served["big"] / served["small"] == pytest.approx(3.0, rel=0.05)


def test_one_tenant_keeps_arrival_order_inside_its_tier() -> None:
    policy = create_policy("strict", EngineConfig())
    reqs = [make_request(tier=Tier.P2, arrival=float(i)) for i in range(5)]
    for r in reqs:
        policy.add(r, 0.0)
    assert drain(policy, 5) == reqs


def _p1(tenant: str, arrival: float) -> Request:
    req = make_request(num_prompt=500, max_tokens=100, tier=Tier.P1, arrival=arrival)
    req.tenant = tenant
    return req


def test_hybrid_judges_a_tier_at_risk_by_its_oldest_request_not_its_fair_head() -> None:
    # Tenant b comes back idle and its fresh request heads the tenant-fair order, while
    # tenant a's request has waited past half the P1 target. A P2 request is at risk too.
    policy = create_policy("hybrid", EngineConfig())
    a1, a2, b1 = _p1("a", 0.0), _p1("a", 37.0), _p1("b", 39.9)
    p2 = make_request(tier=Tier.P2, arrival=0.0)  # 40 s of its 60 s target gone
    for r in (a1, a2, p2):
        policy.add(r, r.arrival_time)
    assert drain(policy, 1, now=0.0) == [a1]
    policy.add(b1, b1.arrival_time)
    assert policy.peek(40.0) is a2, "P1's oldest is at risk: it goes before P2 and before b's fresh head"
    # Then b's request: P1 goes before P2, even a P2 request at risk.
    assert drain(policy, 3, now=40.0) == [a2, b1, p2]


def test_hybrid_rescues_requests_that_can_still_meet_their_target_before_late_ones() -> None:
    # Under overload a P1 request that has waited past its whole 5 s target cannot meet it
    # any more; one that still can is rescued first, then the late one follows.
    policy = create_policy("hybrid", EngineConfig())
    late, savable = _p1("a", 0.0), _p1("a", 7.0)
    policy.add(late, 0.0)
    policy.add(savable, 7.0)
    assert drain(policy, 2, now=10.0) == [savable, late]


def test_token_drr_with_tiny_weights_skips_the_rounds_in_which_no_head_fits() -> None:
    """A quantum of 0.001 tokens against heads of about 1,000: round by round a pop took a
    million rounds (`bench reproduce --config` with such weights never ended). Counted, not
    timed: the rounds are visits to the tiers' heads."""
    from tierserve.config import parse_config

    tiny = {"drr_weight": 1e-3}
    config = parse_config(
        {"scheduler": {"drr_quantum_tokens": 1}, "tiers": dict.fromkeys(("P1", "P2"), tiny)}
    )
    policy = create_policy("drr-tokens", config)
    visits = 0
    head = policy._queues.head  # type: ignore[attr-defined]

    def counted(tier: Tier) -> Request | None:
        nonlocal visits
        visits += 1
        if visits > 10_000:
            raise RuntimeError("still going round")
        found: Request | None = head(tier)
        return found

    policy._queues.head = counted  # type: ignore[attr-defined]
    for i in range(20):
        policy.add(make_request(num_prompt=1000, tier=Tier.P1 if i % 2 else Tier.P2, arrival=i), 0.0)
    served = drain(policy, 20)
    assert len(served) == 20 and visits < 500
