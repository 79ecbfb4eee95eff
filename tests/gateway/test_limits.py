"""The shared limiter's gateway rules: per-tier buckets, per-tier fail rule, 1/N local budget."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tierserve.server.buckets import Bucket, LocalBuckets, TakeResult
from tierserve.server.config import RateLimit, TenantConfig
from tierserve.server.ratelimit import RateLimiter
from tierserve.tiers import Tier

TENANT = TenantConfig(name="t")


class FlakyRemote:
    """A remote backend that works (on local state) until `down` is set."""

    def __init__(self, clock: list[float]) -> None:
        self.down = False
        self._buckets = LocalBuckets(lambda: clock[0])

    async def take(self, buckets: Sequence[Bucket], costs: Sequence[float]) -> TakeResult:
        if self.down:
            raise ConnectionError("redis gone")
        return self._buckets.take_now(buckets, costs)

    async def give(self, bucket: Bucket, amount: float) -> None:
        if self.down:
            raise ConnectionError("redis gone")
        self._buckets.give_now(bucket, amount)


def _admitted(limiter: RateLimiter, tier: Tier, n: int) -> int:
    async def run() -> int:
        return sum([(await limiter.acquire(TENANT, 1, tier)).allowed for _ in range(n)])

    return asyncio.run(run())


def _redis_lost(request_burst: int, **kw: Any) -> tuple[list[float], FlakyRemote, RateLimiter]:
    """A limiter whose Redis is down, P1 failing open and P2 closed, on a clock of its own."""
    clock = [0.0]
    remote = FlakyRemote(clock)
    limiter = RateLimiter(
        RateLimit(requests_per_s=0.001, request_burst=request_burst),
        remote=remote,
        fail_open_tiers={Tier.P1: True, Tier.P2: False},
        now=lambda: clock[0],
        **kw,
    )
    remote.down = True
    return clock, remote, limiter


def test_a_tier_bucket_limits_that_tier_only() -> None:
    clock = [0.0]
    limiter = RateLimiter(
        RateLimit(),
        tier_limits={Tier.P3: RateLimit(requests_per_s=1.0, request_burst=3)},
        now=lambda: clock[0],
    )
    assert _admitted(limiter, Tier.P3, 10) == 3
    assert _admitted(limiter, Tier.P1, 10) == 10


def test_on_redis_loss_open_tiers_get_one_nth_and_closed_tiers_are_refused_then_it_resumes() -> None:
    clock, remote, limiter = _redis_lost(request_burst=40, local_share=0.25)
    refused = asyncio.run(limiter.acquire(TENANT, 1, Tier.P2))
    assert not refused.allowed and refused.reason == "unavailable"  # fail closed, whatever is left
    assert _admitted(limiter, Tier.P1, 40) == 10  # 40 / 4 gateways
    assert _admitted(limiter, Tier.P2, 4) == 0
    assert limiter.redis_up is False and limiter.num_redis_errors >= 1 and limiter.num_fallbacks == 45
    remote.down = False
    clock[0] += 5.0  # past the retry delay
    assert _admitted(limiter, Tier.P2, 50) == 40  # the global bucket, untouched while Redis was away
    assert limiter.redis_up is True


def test_the_charge_before_the_body_falls_back_and_the_tiers_rule_applies_with_its_tokens() -> None:
    """Before the body is read the tier is not known: on Redis loss the request is charged on
    the local buckets while any tier fails open, and a fail-closed tier's request is refused
    once its tier is known (503 `unavailable`), its charge given back; a fail-open one's is
    served."""
    clock, remote, limiter = _redis_lost(request_burst=3)

    async def run(tier: Tier) -> tuple[bool, bool, str]:
        charged = await limiter.acquire_request(TENANT)
        rate = await limiter.acquire(TENANT, 1, tier, charged=charged)
        return charged.fell_back, rate.allowed, rate.reason

    assert asyncio.run(run(Tier.P1)) == (True, True, "")
    assert asyncio.run(run(Tier.P2)) == (True, False, "unavailable")
    assert [asyncio.run(run(Tier.P1))[1] for _ in range(2)] == [True, True]  # the P2 one given back
    assert not asyncio.run(limiter.acquire_request(TENANT)).allowed
    everyone_closed = RateLimiter(
        RateLimit(requests_per_s=0.001, request_burst=40),
        remote=remote,
        fail_open=False,
        fail_open_tiers={Tier.P1: False, Tier.P2: False},
        now=lambda: clock[0],
    )
    refused = asyncio.run(everyone_closed.acquire_request(TENANT))
    assert not refused.allowed and refused.reason == "unavailable"
