"""`Policy.put_back`: a request popped and then not run (vLLM skips a waiting request whose
grammar is still compiling or whose LoRA has no slot, by popping
it and putting it back at the end of the pass) waits again as if it had not been popped,
and its tenant and tier are not charged for it."""

from __future__ import annotations

import random
from itertools import islice

import pytest

from tests.conftest import make_request
from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling import create_policy
from tierserve.scheduling.base import Policy
from tierserve.scheduling.registry import policy_names
from tierserve.tiers import Tier

FAIR_POLICIES = ("hybrid", "wfq", "article", "strict", "drr", "drr-tokens")
VARIANTS = ("plain", "abort", "passes", "look")


def _request(rid: str, tier: Tier, tenant: str, weight: float, arrival: float, rng: random.Random) -> Request:
    req = make_request(num_prompt=rng.randint(8, 400), tier=tier, arrival=arrival, request_id=rid)
    req.tenant, req.tenant_weight = tenant, weight
    req.expected_output_tokens = rng.randint(1, 300)
    return req


def _twin_run(name: str, seed: int, variant: str, ops: int = 1200) -> str | None:
    """Policy `a` (with `keep_undo`) runs skipped passes before each real pop: 1-5 pops put
    back in the reverse order, as vLLM puts back what it skips; `b` runs without them. Both
    get the same arrivals (1-60 tenants of weights 0.5-5, popped slower than they arrive at
    times, so that aging, the rescue's windows and the held-back backstop are reached),
    preemptions and aborts. Variants: an abort between a pass's pops and its put-backs;
    several skipped passes in a row, time moving between them; `a` without `keep_undo`,
    looking ahead at 1-5 requests (`Policy.looking_ahead`, as tierserve's own pass does)
    before each pop, which must then be the first it saw. Returns the first pop that
    differs, if any."""
    rng = random.Random(seed)
    a, b = create_policy(name, EngineConfig()), create_policy(name, EngineConfig())
    a.keep_undo(variant != "look")  # looking ahead keeps what it needs, only while it looks
    twins: dict[str, tuple[Request, Request]] = {}
    running: list[str] = []
    tenants = {f"t{i}": rng.choice((0.5, 1.0, 2.0, 5.0)) for i in range(rng.choice((1, 3, 12, 60)))}
    rate, pop_share = rng.choice((2.0, 6.0, 20.0)), rng.choice((0.3, 0.45, 0.6))
    now, serial = 0.0, 0
    for step in range(ops):
        now += rng.expovariate(rate)
        op = rng.random()
        if op < 0.5:
            serial += 1
            tier = Tier(rng.choice((0, 1, 1, 2, 2, 3, 3, 3)))
            tenant, seed_of_lengths = rng.choice(list(tenants)), rng.random()
            pair = tuple(
                _request(f"r{serial}", tier, tenant, tenants[tenant], now, random.Random(seed_of_lengths))
                for _ in range(2)
            )
            twins[f"r{serial}"] = pair  # type: ignore[assignment]
            a.add(pair[0], now)
            b.add(pair[1], now)
        elif op < 0.5 + pop_share and len(b) and variant == "look":
            with a.looking_ahead(now) as waiting:  # a pass asking whom it would admit
                seen = [r.request_id for r in islice(waiting, rng.randint(1, 5))]
            got, want = a.pop(now), b.pop(now)
            if a.keeps_undo or (got.request_id, want.request_id) != (seen[0], seen[0]):
                return f"step {step}, t={now:.2f}: looked at {seen}, then popped {got.request_id}"
            running.append(got.request_id)
        elif op < 0.5 + pop_share and len(b):
            for _ in range(rng.randint(1, 4) if variant == "passes" else 1):
                taken = [a.pop(now) for _ in range(min(len(a), rng.randint(1, 5)))]
                if variant == "abort" and rng.random() < 0.5 and len(b):
                    rid = rng.choice([r.request_id for r in b])
                    if any(r.request_id == rid for r in a):
                        a.remove(twins[rid][0])
                        b.remove(twins[rid][1])
                for req in reversed(taken):
                    a.put_back(req, now)
                a.forget_undo()  # the pass is over
                if variant == "passes":
                    now += rng.choice((0.0, 0.001, 0.5))
            if not len(b):
                continue
            got, want = a.pop(now), b.pop(now)
            a.forget_undo()
            if got.request_id != want.request_id:
                return (
                    f"step {step}, t={now:.2f}: {got.request_id} ({got.tenant}) instead of {want.request_id}"
                )
            running.append(got.request_id)
        elif running and rng.random() < 0.3:
            rid = running.pop(rng.randrange(len(running)))  # preempted
            a.prepend(twins[rid][0], now)
            b.prepend(twins[rid][1], now)
        elif len(b) and rng.random() < 0.1:
            rid = rng.choice([r.request_id for r in b])  # aborted
            a.remove(twins[rid][0])
            b.remove(twins[rid][1])
    order = [(a.pop(now).request_id, b.pop(now).request_id) for _ in range(len(b))]
    return next((f"drain: {x} instead of {y}" for x, y in order if x != y), None)


# An abort between a pass's pops and its put-backs, which vLLM never does (it applies aborts
# between passes), can still move one of hybrid's held-back clocks: an abort carries no
# time, and the pops brought hybrid's lists up to the pass's.
TWIN_CASES = [(n, v) for n in policy_names() for v in VARIANTS if (n, v) != ("hybrid", "abort")]


@pytest.mark.parametrize(("name", "variant"), TWIN_CASES)
def test_skipped_passes_leave_the_order_as_it_was(name: str, variant: str) -> None:
    """Every pop over 1,200 random operations, 4 seeds, is the one the policy makes without
    the skipped passes: a skip changes no tag, deficit, clock, rescue or held-back time.
    (Hybrid's diverged: its tenants' start tags went down under the rescue's lazy heap, and
    its held-back clocks started at whichever pass happened to look.)"""
    for seed in range(4):
        assert _twin_run(name, seed, variant) is None, f"seed {seed}"


def _p2(policy: Policy, rid: str, tenant: str, arrival: float) -> Request:
    req = make_request(num_prompt=100, tier=Tier.P2, arrival=arrival, request_id=rid)
    req.tenant, req.expected_output_tokens = tenant, 100
    policy.add(req, arrival)
    return req


@pytest.mark.parametrize("name", FAIR_POLICIES)
@pytest.mark.parametrize("undo", [True, False])
def test_a_request_skipped_for_many_passes_costs_its_tenant_nothing(name: str, undo: bool) -> None:
    """Tenants a and b share P2 equally. b's first request is skipped in 30 passes (a LoRA
    waiting for a slot) while one request is admitted a pass: b's other requests keep its
    half, and once runnable the request goes at once. Its pop is not the pass's latest when
    it is put back, so its cost is refunded, with or without `keep_undo`."""
    policy = create_policy(name, EngineConfig())
    policy.keep_undo(undo)
    for i in range(40):
        _p2(policy, f"a{i}", "a", 0.001 * i)
    skipped = _p2(policy, "b0", "b", 0.0005)
    for i in range(1, 40):
        _p2(policy, f"b{i}", "b", 0.001 * i + 0.0005)
    now, admitted = 1.0, []
    for _ in range(30):  # one pass: b0 is skipped, the next request is admitted
        now += 0.01
        taken = []
        while True:
            req = policy.pop(now)
            if req is not skipped:
                admitted.append(req.tenant)
                break
            taken.append(req)
        for req in reversed(taken):
            policy.put_back(req, now)
        policy.forget_undo()
    assert abs(admitted.count("a") - admitted.count("b")) <= 2, f"not half each: {admitted}"
    now += 0.01
    first = [policy.pop(now).request_id for _ in range(2)]
    assert "b0" in first, f"b0, runnable again, waited behind {first}"


@pytest.mark.parametrize("name", FAIR_POLICIES)
def test_pops_keep_nothing_for_put_back_unless_asked(name: str) -> None:
    """tierserve's own engine never puts a request back: its pops kept the latest 256 serves
    of every fair queue (the requests, and emptied flows with them) all the same, and
    hybrid a list per tenant that grew by one at every serve under a backlog (200,000 pops:
    199,500 entries). With `keep_undo`, a pass's records go when it ends."""
    rng = random.Random(7)
    for undo in (False, True):
        policy = create_policy(name, EngineConfig())
        policy.keep_undo(undo)
        now = 0.0
        for i in range(3000):
            now += 0.01
            policy.add(_request(f"r{i}", Tier(i % 4), f"t{i % 7}", 1.0, now - 10.0, rng), now)
            if i % 3 == 0:
                policy.pop(now)
                policy.forget_undo()
        held = _undo_records(policy)
        assert held == 0, f"keep_undo({undo}): {held} records held after the passes"


def _undo_records(policy: Policy) -> int:
    """The undo records a policy holds, wherever they are."""
    seen, count, stack = set(), 0, [policy]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            continue
        seen.add(id(obj))
        for key, value in vars(obj).items():
            if key in ("_served", "_taken", "_popped", "_relist_since"):
                count += len(value)
            elif isinstance(value, dict):
                stack.extend(v for v in value.values() if hasattr(v, "__dict__"))
            elif isinstance(value, (list, tuple)):
                stack.extend(v for v in value if hasattr(v, "__dict__") and not isinstance(v, Request))
            elif hasattr(value, "__dict__") and not isinstance(value, (Request, EngineConfig)):
                stack.append(value)
    return count


def test_a_p0_prompt_put_back_after_a_later_one_ran_takes_back_its_own_record() -> None:
    """vLLM puts back what it skipped at the end of the pass, after later pops of it were
    admitted. Hybrid undid its latest record of recent P0 prompts, the admitted one's: after
    ten such passes of 6,000-token prompts its step bound was sized for 100 tokens."""
    policy = create_policy("hybrid", EngineConfig())
    policy.keep_undo(True)
    skipped = make_request(num_prompt=100, tier=Tier.P0, arrival=0.0, request_id="skipped")
    for i in range(10):
        admitted = make_request(num_prompt=6000, tier=Tier.P0, arrival=0.1 + i, request_id=f"admitted{i}")
        now = 1.0 + i
        if i == 0:
            policy.add(skipped, now)
        policy.add(admitted, now)
        assert (policy.pop(now), policy.pop(now)) == (skipped, admitted)
        policy.put_back(skipped, now)
        policy.forget_undo()
    assert list(policy._shaper._recent_p0) == [6000] * 10  # type: ignore[attr-defined]


def test_a_preempted_request_holds_its_tenant_back_from_its_return_not_its_arrival() -> None:
    """Its tenant counted as held back from the request's arrival + aging_s, time it spent
    running: back after 100 s, it went ahead of the tenant-fair order at once (past the
    50 s backstop)."""
    policy = create_policy("hybrid", EngineConfig())
    xs = [_aged("x", f"x{i}", 0.0) for i in range(20)]
    ks = [_aged("k", f"k{i}", 0.05) for i in range(200)]
    for req in xs + ks:
        policy.add(req, req.arrival_time)
    running: list[Request] = []
    t = 0.1
    while len(running) < 20:
        req = policy.pop(t)
        t += 0.01
        if req.tenant == "x":
            running.append(req)
    for i in range(10):
        policy.add(_aged(f"o{i}", f"o{i}", 80.0 + i), 80.0 + i)
    policy.prepend(running[0], 100.0)  # x0, which arrived at 0 s and ran, is preempted
    order = [policy.pop(100.0 + 0.01 * k).request_id for k in range(12)]
    assert order[0] != "x0", order


def _aged(tenant: str, rid: str, arrival: float) -> Request:
    req = make_request(num_prompt=100, tier=Tier.P3, arrival=arrival, request_id=rid)
    req.tenant = tenant
    return req


def test_a_pass_of_more_pops_than_the_records_kept_still_lets_them_all_go() -> None:
    """`forget_undo` reached the queues through the latest 256 serves only: after a pass of
    300 pops, aged P3 requests first, P3 (still waiting) kept their records."""
    policy = create_policy("hybrid", EngineConfig())
    policy.keep_undo(True)
    p3 = [_aged(f"a{i}", f"a{i}", 0.0) for i in range(5)] + [_aged(f"y{i}", f"y{i}", 99.9) for i in range(5)]
    p1 = [make_request(num_prompt=16, tier=Tier.P1, arrival=99.8, request_id=f"p{i}") for i in range(300)]
    for req in p3 + p1:
        policy.add(req, req.arrival_time)
    for _ in range(300):
        policy.pop(100.0)
    policy.forget_undo()
    assert len(policy) == 10 and _undo_records(policy) == 0


def test_a_request_skipped_pass_after_pass_behind_other_tenants_keeps_its_tenants_held_back_clock() -> None:
    """vLLM puts a skipped request back after the pass's later pops ran. When those were
    other tenants', the skipped request's pop still reset its tenant's held-back clock: a
    request waiting 50 passes for a LoRA slot kept its tenant from ever reaching the backstop."""
    policy = create_policy("hybrid", EngineConfig())
    policy.keep_undo(True)
    skipped, other = _aged("T", "A", 0.0), _aged("T", "X", 0.1)
    for req in (skipped, other):
        policy.add(req, req.arrival_time)
    aged = policy._aged_by_tenant[Tier.P3]  # type: ignore[attr-defined]
    for k in range(50):
        now = 10.0 + k
        one_shot = _aged(f"u{k}", f"u{k}", now - 6.0)  # a new tenant's, aged, goes first
        policy.add(one_shot, now)
        popped = []
        while not popped or popped[-1] is skipped:
            popped.append(policy.pop(now))
        assert popped[0] is skipped  # then the one-shot tenant's, which runs
        for req in reversed(popped[:-1]):
            policy.put_back(req, now)
        policy.forget_undo()
    assert aged.held_since("T") == 5.0  # A's arrival + aging_s: no serve of T ran


def test_a_p0_prompt_put_back_after_another_tiers_pop_ran_is_undone_exactly() -> None:
    policy = create_policy("hybrid", EngineConfig())
    policy.keep_undo(True)
    shaper = policy._shaper  # type: ignore[attr-defined]
    for i in range(40):
        shaper.p0_admitted(9000 + i)
    before = list(shaper._recent_p0)
    p0 = make_request(num_prompt=100, tier=Tier.P0, arrival=0.0, request_id="p0")
    p1 = make_request(num_prompt=200, tier=Tier.P1, arrival=0.1, request_id="p1")
    for req in (p0, p1):
        policy.add(req, 1.0)
    assert (policy.pop(1.0), policy.pop(1.0)) == (p0, p1)
    policy.put_back(p0, 1.0)
    assert list(shaper._recent_p0) == before
