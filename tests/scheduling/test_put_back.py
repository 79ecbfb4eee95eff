"""`Policy.put_back`: a request popped and then not run (vLLM skips a waiting request whose
grammar is still compiling, whose KV is in transfer, or whose LoRA has no slot, by popping
it and putting it back at the end of the pass) waits again as if it had not been popped,
and its tenant and tier are not charged for it."""

from __future__ import annotations

import random

import pytest

from tests.conftest import make_request
from tierserve.config import EngineConfig
from tierserve.request import Request
from tierserve.scheduling import create_policy
from tierserve.scheduling.base import Policy
from tierserve.scheduling.registry import policy_names
from tierserve.tiers import Tier

FAIR_POLICIES = ("hybrid", "wfq", "article", "strict", "drr", "drr-tokens")


def _request(rid: str, tier: Tier, tenant: str, arrival: float, rng: random.Random) -> Request:
    req = make_request(num_prompt=rng.randint(8, 400), tier=tier, arrival=arrival, request_id=rid)
    req.tenant = tenant
    req.tenant_weight = {"a": 1.0, "b": 2.0, "c": 3.0}[tenant]
    req.expected_output_tokens = rng.randint(1, 300)
    return req


def _twins(name: str, seed: int, skips: bool) -> list[str]:
    """The ids a policy pops over a random run of arrivals, pops and preemptions; with
    `skips`, every real pop comes after a pass that pops 1-4 requests and puts them all back
    (in the reverse order, as vLLM does) at the same instant."""
    rng = random.Random(seed)
    skip_rng = random.Random(seed + 1)  # the skips draw from their own stream
    policy = create_policy(name, EngineConfig())
    now, popped, serial = 0.0, [], 0
    running: list[Request] = []
    for _ in range(400):
        now += rng.expovariate(4.0)
        op = rng.random()
        if op < 0.5:
            serial += 1
            tier = Tier(rng.choice((0, 1, 1, 2, 2, 3, 3, 3)))
            policy.add(_request(f"r{serial}", tier, rng.choice("abc"), now, rng), now)
        elif op < 0.9 and len(policy):
            if skips:
                taken = [policy.pop(now) for _ in range(min(len(policy), skip_rng.randint(1, 4)))]
                for req in reversed(taken):
                    policy.put_back(req, now)
            req = policy.pop(now)
            popped.append(req.request_id)
            running.append(req)
        elif running:
            policy.prepend(running.pop(rng.randrange(len(running))), now)  # preempted
    while len(policy):
        popped.append(policy.pop(now).request_id)
    return popped


@pytest.mark.parametrize("name", policy_names())
@pytest.mark.parametrize("seed", range(6))
def test_a_pass_of_skips_leaves_the_order_as_it_was(name: str, seed: int) -> None:
    """The whole sequence of pops, over 400 random operations with skipped passes before
    every pop, is the sequence without them: a skip changes no tag, deficit or clock."""
    assert _twins(name, seed, skips=True) == _twins(name, seed, skips=False)


def _p2(policy: Policy, rid: str, tenant: str, arrival: float) -> Request:
    req = make_request(num_prompt=100, tier=Tier.P2, arrival=arrival, request_id=rid)
    req.tenant, req.expected_output_tokens = tenant, 100
    policy.add(req, arrival)
    return req


@pytest.mark.parametrize("name", FAIR_POLICIES)
def test_a_request_skipped_for_many_passes_costs_its_tenant_nothing(name: str) -> None:
    """Tenants a and b share P2 equally. b's first request is skipped in 30 passes (a LoRA
    waiting for a slot) while one request is admitted a pass: b's other requests keep its
    half, and once runnable the request goes at once."""
    policy = create_policy(name, EngineConfig())
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
    assert abs(admitted.count("a") - admitted.count("b")) <= 2, f"not half each: {admitted}"
    now += 0.01
    first = [policy.pop(now).request_id for _ in range(2)]
    assert "b0" in first, f"b0, runnable again, waited behind {first}"
