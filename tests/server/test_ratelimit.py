from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

import pytest

from tests.conftest import NO_REDIS
from tierserve.server.buckets import Bucket, BucketLevel, LocalBuckets, TakeResult
from tierserve.server.config import RateLimit, TenantConfig
from tierserve.server.ratelimit import REDIS_RETRY_S, RateLimiter, Reservation, format_reset


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_bucket_allows_its_burst_then_refills_at_its_rate() -> None:
    now = FakeTime()
    buckets = LocalBuckets(now)
    b = Bucket("b", rate_per_s=2.0, capacity=3.0)
    assert [buckets.take_now([b], [1]).allowed for _ in range(4)] == [True, True, True, False]
    refused = buckets.take_now([b], [1])
    assert refused.wait_s == pytest.approx(0.5)
    now.t += 0.5
    assert buckets.take_now([b], [1]).allowed
    now.t += 100
    assert buckets.take_now([b], [3]).levels[0].remaining == pytest.approx(0.0)  # capped at capacity


def test_take_debits_every_bucket_or_none() -> None:
    buckets = LocalBuckets(FakeTime())
    wide, narrow = Bucket("wide", 1.0, 100.0), Bucket("narrow", 1.0, 5.0)
    assert not buckets.take_now([wide, narrow], [10, 10]).allowed
    result = buckets.take_now([wide, narrow], [5, 5])
    assert result.allowed and [lv.remaining for lv in result.levels] == [95.0, 0.0]


def test_give_refunds_up_to_capacity_and_charges_into_debt() -> None:
    now = FakeTime()
    buckets = LocalBuckets(now)
    b = Bucket("b", 10.0, 100.0)
    buckets.take_now([b], [80])
    buckets.give_now(b, 500)
    assert buckets.take_now([b], [0]).levels[0].remaining == 100.0
    buckets.give_now(b, -150)
    refused = buckets.take_now([b], [1])
    assert not refused.allowed and refused.wait_s == pytest.approx(5.1)


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.02, "20ms"), (1.5, "1.5s"), (360, "6m0s"), (61.25, "1m1.25s")]
)
def test_reset_durations_are_written_as_openai_does(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def _tenant(**limit: float) -> TenantConfig:
    return TenantConfig(name="t", limit=RateLimit(**limit))


def test_limiter_refuses_over_the_tenant_limit_with_openai_headers() -> None:
    now = FakeTime()
    limiter = RateLimiter(RateLimit(), now=now)
    tenant = _tenant(requests_per_s=1.0, request_burst=2.0, tokens_per_s=100.0, token_burst=1000.0)

    async def scenario() -> None:
        first = await limiter.acquire(tenant, 300)
        assert first.allowed
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-limit-tokens"] == "1000"
        assert first.headers["x-ratelimit-remaining-tokens"] == "700"
        assert first.headers["x-ratelimit-reset-tokens"] == "3s"
        second = await limiter.acquire(tenant, 800)  # requests left, tokens short
        assert not second.allowed and second.reason == "tokens"
        assert second.headers["Retry-After"] == "1" and second.headers["retry-after-ms"] == "1000"
        await limiter.settle(first.reservation, 100)  # used 100 of 300: 200 come back
        assert (await limiter.acquire(tenant, 800)).allowed
        third = await limiter.acquire(tenant, 1)
        assert not third.allowed and third.reason == "requests"

    asyncio.run(scenario())


def test_request_larger_than_the_bucket_is_refused_as_too_large() -> None:
    limiter = RateLimiter(RateLimit(tokens_per_s=10.0, token_burst=50.0))
    decision = asyncio.run(limiter.acquire(_tenant(), 51))
    assert not decision.allowed and decision.reason == "too_large" and "51" in decision.message
    assert "Retry-After" not in decision.headers


def test_a_default_output_is_cut_to_the_burst_and_settled_to_the_real_count() -> None:
    """A tenant with token_burst = 300 and the server's default of 512 output tokens: every
    request without max_tokens was refused as too large, on every retry. Only the
    output the client did not ask for is cut; the prompt and one token must still fit."""
    now = FakeTime()
    limiter = RateLimiter(RateLimit(), now=now)
    tenant = _tenant(tokens_per_s=100.0, token_burst=300.0)

    async def scenario() -> None:
        first = await limiter.acquire(tenant, 20 + 512, num_default=512)
        assert first.allowed and first.reservation is not None
        assert first.reservation.num_tokens == 300
        await limiter.settle(first.reservation, 20 + 480)  # used 500: 200 more than reserved
        later = await limiter.acquire(tenant, 20 + 512, num_default=512)
        assert not later.allowed and later.reason == "tokens"  # it fits once the debt is paid
        assert later.headers["Retry-After"] == "5"  # from -200 to 300 at 100 tokens/s
        now.t += 5
        assert (await limiter.acquire(tenant, 20 + 512, num_default=512)).allowed
        prompt_too_long = await limiter.acquire(tenant, 300 + 512, num_default=512)
        assert prompt_too_long.reason == "too_large" and "301 tokens requested" in prompt_too_long.message
        explicit = await limiter.acquire(tenant, 20 + 512)  # max_tokens = 512, asked for
        assert explicit.reason == "too_large" and "532 tokens requested" in explicit.message

    asyncio.run(scenario())


def test_no_limits_means_no_headers_and_no_reservation() -> None:
    decision = asyncio.run(RateLimiter(RateLimit()).acquire(_tenant(), 10**9))
    assert decision.allowed and decision.headers == {} and decision.reservation is None


class BrokenBackend:
    calls = 0

    async def take(self, buckets: Sequence[Bucket], costs: Sequence[float]) -> TakeResult:
        self.calls += 1
        raise ConnectionError("redis is down")

    async def give(self, bucket: Bucket, amount: float) -> None:
        raise ConnectionError("redis is down")


def test_fail_open_keeps_limiting_on_local_buckets_and_says_so() -> None:
    backend = BrokenBackend()
    limiter = RateLimiter(RateLimit(requests_per_s=1.0, request_burst=2.0), remote=backend, fail_open=True)

    async def scenario() -> list[bool]:
        return [(await limiter.acquire(_tenant(), 1)).allowed for _ in range(3)]

    assert asyncio.run(scenario()) == [True, True, False]
    assert limiter.redis_up is False and limiter.num_fallbacks == 3
    assert backend.calls == 1  # then it waits before trying Redis again


class FlakyBackend(BrokenBackend):
    """Down until `up` is set; then every take is allowed."""

    up = False

    async def take(self, buckets: Sequence[Bucket], costs: Sequence[float]) -> TakeResult:
        if not self.up:
            return await super().take(buckets, costs)
        return TakeResult(True, tuple(BucketLevel(b.capacity, 0.0) for b in buckets))


def test_a_redis_outage_and_its_recovery_are_logged_once_each(caplog: pytest.LogCaptureFixture) -> None:
    now = FakeTime()
    backend = FlakyBackend()
    limiter = RateLimiter(RateLimit(requests_per_s=1000.0), remote=backend, fail_open=True, now=now)

    async def requests(n: int) -> None:
        for _ in range(n):
            await limiter.acquire(_tenant(), 1)
            now.t += REDIS_RETRY_S  # every request retries Redis
        await limiter.settle(Reservation(backend, (Bucket("x", 1.0, 1.0),), 5), 1)

    caplog.set_level(logging.INFO, logger="tierserve.server")
    asyncio.run(requests(20))
    backend.up = True
    asyncio.run(requests(20))
    lines = [r.getMessage() for r in caplog.records]
    assert backend.calls >= 20
    assert sum("unreachable" in line for line in lines) == 2  # the outage, and the failed settle after
    assert sum("reachable again" in line for line in lines) == 1
    assert all(not r.exc_info for r in caplog.records)


def test_fail_closed_refuses_while_the_backend_is_down() -> None:
    limiter = RateLimiter(RateLimit(requests_per_s=100.0), remote=BrokenBackend(), fail_open=False)
    decision = asyncio.run(limiter.acquire(_tenant(), 1))
    assert not decision.allowed and decision.reason == "unavailable" and "Retry-After" in decision.headers


# ---- Redis (the real server on 127.0.0.1:6379; skipped when it is not there) ----------------

REDIS_URL = "redis://127.0.0.1:6379/15"


def _redis_or_skip() -> None:
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.2).ping()
    except (redis.RedisError, OSError):
        pytest.skip(NO_REDIS)


def test_redis_buckets_are_shared_by_replicas_and_atomic() -> None:
    _redis_or_skip()
    from tierserve.server.redis_buckets import RedisBuckets

    prefix = f"tierserve-test-{uuid.uuid4().hex}"
    limit = RateLimit(requests_per_s=0.001, request_burst=10.0)

    async def scenario() -> tuple[int, bool | None]:
        replicas = [RedisBuckets(REDIS_URL, timeout_s=1.0, key_prefix=prefix) for _ in range(2)]
        limiters = [RateLimiter(limit, remote=r) for r in replicas]
        decisions = await asyncio.gather(*(limiters[i % 2].acquire(_tenant(), 1) for i in range(30)))
        for r in replicas:
            await r.close()
        return sum(d.allowed for d in decisions), limiters[0].redis_up

    allowed, up = asyncio.run(scenario())
    assert allowed == 10 and up is True


def test_redis_give_settles_tokens() -> None:
    _redis_or_skip()
    from tierserve.server.redis_buckets import RedisBuckets

    prefix = f"tierserve-test-{uuid.uuid4().hex}"

    async def scenario() -> tuple[bool, bool]:
        backend = RedisBuckets(REDIS_URL, timeout_s=1.0, key_prefix=prefix)
        limiter = RateLimiter(RateLimit(tokens_per_s=0.001, token_burst=100.0), remote=backend)
        first = await limiter.acquire(_tenant(), 100)
        await limiter.settle(first.reservation, 40)  # 60 come back
        refused = (await limiter.acquire(_tenant(), 61)).allowed
        fits = (await limiter.acquire(_tenant(), 60)).allowed
        await backend.close()
        return refused, fits

    assert asyncio.run(scenario()) == (False, True)


def test_redis_cuts_a_default_output_to_the_burst_and_keeps_the_debt_as_local_buckets_do() -> None:
    _redis_or_skip()
    from tierserve.server.redis_buckets import RedisBuckets

    prefix = f"tierserve-test-{uuid.uuid4().hex}"

    async def scenario() -> tuple[int | None, str, str]:
        backend = RedisBuckets(REDIS_URL, timeout_s=1.0, key_prefix=prefix)
        limiter = RateLimiter(RateLimit(), remote=backend)
        tenant = _tenant(tokens_per_s=0.001, token_burst=300.0)
        first = await limiter.acquire(tenant, 20 + 512, num_default=512)
        await limiter.settle(first.reservation, 20 + 480)  # 200 beyond the reservation
        later = await limiter.acquire(tenant, 100)
        await backend.close()
        reserved = None if first.reservation is None else first.reservation.num_tokens
        return reserved, later.reason, later.headers["x-ratelimit-remaining-tokens"]

    assert asyncio.run(scenario()) == (300, "tokens", "0")  # in debt: -200 left


def test_a_debt_settled_after_the_bucket_refilled_is_charged_by_redis_as_by_local_buckets() -> None:
    """A request that used 116 tokens past its reservation, settled once the bucket had
    refilled past full: Redis capped refill and debt together and forgave it (400 left,
    where the local buckets leave 284)."""
    _redis_or_skip()
    from tierserve.server.redis_buckets import RedisBuckets

    bucket = Bucket(f"debt-{uuid.uuid4().hex}", rate_per_s=800.0, capacity=400.0)

    async def left(backend: RedisBuckets | LocalBuckets) -> float:
        await backend.take([bucket], [400.0])  # all of it: 0 left
        await asyncio.sleep(0.6)  # refills past full (480 tokens' worth), capped at 400
        await backend.give(bucket, -116.0)
        return (await backend.take([bucket], [0.0])).levels[0].remaining

    async def both() -> tuple[float, float]:
        redis_backend = RedisBuckets(
            REDIS_URL, timeout_s=1.0, key_prefix=f"tierserve-test-{uuid.uuid4().hex}"
        )
        try:
            return await left(redis_backend), await left(LocalBuckets())
        finally:
            await redis_backend.close()

    remote, local = asyncio.run(both())
    # 284, and what refills between the settle and the reading (0.8 a ms): the old 384 is far.
    assert local == pytest.approx(284.0, abs=40.0)
    assert remote == pytest.approx(284.0, abs=40.0)


def test_unreachable_redis_fails_open_onto_local_buckets() -> None:
    pytest.importorskip("redis")
    from tierserve.server.redis_buckets import RedisBuckets

    async def scenario() -> tuple[bool, bool | None, int]:
        backend = RedisBuckets("redis://127.0.0.1:1/0", timeout_s=0.2, key_prefix="x")
        limiter = RateLimiter(RateLimit(requests_per_s=10.0), remote=backend, fail_open=True)
        decision = await limiter.acquire(_tenant(), 1)
        await backend.close()
        return decision.allowed, limiter.redis_up, limiter.num_fallbacks

    assert asyncio.run(scenario()) == (True, False, 1)


def test_unlimited_tenants_leave_no_buckets_behind() -> None:
    """An open server labels a tenant per x-tenant-id: memory must not grow with the names."""
    limiter = RateLimiter(RateLimit(requests_per_s=1000.0, request_burst=1000.0))

    async def go() -> None:
        for i in range(300):
            assert (await limiter.acquire(TenantConfig(name=f"adhoc-{i}"), 1)).allowed
        await limiter.acquire(_tenant(requests_per_s=5.0), 1)

    asyncio.run(go())
    assert list(limiter._tenant_buckets) == [_tenant().name]


def test_a_refusal_names_the_limit_that_ran_out() -> None:
    """With only a server-wide limit, the 429 must not blame the tenant's own."""
    limiter = RateLimiter(RateLimit(requests_per_s=1.0, request_burst=1.0), now=FakeTime())

    async def scenario() -> tuple[str, str]:
        assert (await limiter.acquire(_tenant(), 1)).allowed
        server_wide = await limiter.acquire(_tenant(), 1)
        own = RateLimiter(RateLimit(), now=FakeTime())
        tenant = _tenant(tokens_per_s=1.0, token_burst=10.0)
        assert (await own.acquire(tenant, 10)).allowed
        return server_wide.message, (await own.acquire(tenant, 5)).message

    server_wide, own = asyncio.run(scenario())
    assert server_wide == "Rate limit reached: the server-wide limit (requests)."
    assert own == "Rate limit reached: tenant 't' (tokens)."


def test_a_request_too_large_names_the_tightest_limit() -> None:
    """The server-wide bucket (2,000 tokens) was named although the tenant's (300) was the
    one that could never hold the request."""
    tenant = TenantConfig(name="acme", limit=RateLimit(tokens_per_s=300.0, token_burst=300.0))
    limiter = RateLimiter(RateLimit(tokens_per_s=2000.0, token_burst=2000.0))
    decision = asyncio.run(limiter.acquire(tenant, 5000))
    assert decision.reason == "too_large" and "tenant 'acme' allows at most 300 at once" in decision.message


def test_a_take_that_timed_out_is_not_sent_again() -> None:
    """The take is not idempotent: sent again after a timeout, a slow Redis ran it twice and
    the tenant paid twice for a request it was refused (503). Only a broken connection (a
    stale pooled one, after Redis restarts) is worth a second try."""
    pytest.importorskip("redis")
    from tierserve.server.redis_buckets import RedisBuckets

    scripts: list[bytes] = []

    async def silent_on_scripts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A RESP server that answers the connection's set-up and never a script.
        while line := await reader.readline():
            if not line.startswith(b"*"):
                continue
            words = []
            for _ in range(int(line[1:])):
                size = int((await reader.readline())[1:])
                words.append((await reader.readexactly(size + 2))[:-2])
            if words[0].upper() in (b"EVALSHA", b"EVAL"):
                scripts.append(words[0])
            else:
                writer.write(b"+OK\r\n")
                await writer.drain()

    async def scenario() -> None:
        server = await asyncio.start_server(silent_on_scripts, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        backend = RedisBuckets(f"redis://127.0.0.1:{port}/0", timeout_s=0.2, key_prefix="x")
        limiter = RateLimiter(RateLimit(requests_per_s=10.0), remote=backend, fail_open=False)
        decision = await limiter.acquire(_tenant(), 1)
        assert decision.reason == "unavailable"
        await backend.close()
        server.close()

    asyncio.run(scenario())
    assert len(scripts) == 1


def test_a_request_past_a_gateways_share_of_the_burst_still_runs_while_redis_is_down() -> None:
    """Two gateway instances, Redis down: each falls back on half of every bucket. A request
    of 300 tokens (the burst is 400) was refused with a Retry-After of 2 s, again and again,
    for as long as Redis stayed away: half a bucket never holds 300."""

    class DownRedis:
        async def take(self, buckets: Sequence[Bucket], costs: Sequence[float]) -> TakeResult:
            raise ConnectionError("refused")

        async def give(self, bucket: Bucket, amount: float) -> None:
            raise ConnectionError("refused")

    async def scenario() -> tuple[bool, int | None, bool, str]:
        now = FakeTime()
        limiter = RateLimiter(RateLimit(), remote=DownRedis(), fail_open=True, local_share=0.5, now=now)  # type: ignore[arg-type]
        tenant = _tenant(tokens_per_s=100.0, token_burst=400.0)
        first = await limiter.acquire(tenant, 300)
        reserved = None if first.reservation is None else first.reservation.num_tokens
        await limiter.settle(first.reservation, 300)  # the 100 past the share, as a debt: -100 left
        again = await limiter.acquire(tenant, 200)  # the share refills at 50 a second: 6 s
        return first.allowed, reserved, again.allowed, again.headers["Retry-After"]

    assert asyncio.run(scenario()) == (True, 200, False, "6")  # 4 s without the debt


def test_the_request_charged_before_the_body_is_not_charged_again_with_its_tokens() -> None:
    """`acquire_request` takes the request buckets (global and tenant) before the body is
    read; `acquire` given that charge takes only the tokens, so a request costs one."""
    now = FakeTime()
    limiter = RateLimiter(RateLimit(requests_per_s=0.001, request_burst=10), now=now)
    tenant = _tenant(requests_per_s=0.001, request_burst=2, tokens_per_s=1.0, token_burst=100)

    async def run() -> list[str]:
        out = []
        for _ in range(2):
            charged = await limiter.acquire_request(tenant)
            assert charged.allowed
            rate = await limiter.acquire(tenant, 10, charged=charged)
            assert rate.allowed and rate.reservation is not None
            out.append(rate.headers["x-ratelimit-remaining-requests"])
        refused = await limiter.acquire_request(tenant)
        assert not refused.allowed and refused.reason == "requests"
        assert refused.message == "Rate limit reached: tenant 't' (requests)."
        assert "x-ratelimit-limit-tokens" in refused.headers  # read, not charged
        return out

    assert asyncio.run(run()) == ["1", "0"]


def test_a_tenant_in_token_debt_is_refused_before_its_body() -> None:
    now = FakeTime()
    limiter = RateLimiter(RateLimit(), now=now)
    tenant = _tenant(requests_per_s=100.0, tokens_per_s=10.0, token_burst=100)

    async def run() -> tuple[bool, str, float]:
        rate = await limiter.acquire(tenant, 100)
        await limiter.settle(rate.reservation, 150)  # 50 past the reservation: a debt
        early = await limiter.acquire_request(tenant)
        return early.allowed, early.reason, early.retry_after_s

    assert asyncio.run(run()) == (False, "tokens", pytest.approx(5.0))
