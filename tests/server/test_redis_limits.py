"""Rate limits shared through Redis by two server replicas, and the rule when Redis is down."""

from __future__ import annotations

import logging
import re
import uuid
from typing import Any

import httpx
import pytest

from tests.conftest import NO_REDIS
from tests.server.helpers import MODEL, live_server, make_state
from tierserve.server.config import parse_serve_config

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
REDIS_URL = "redis://127.0.0.1:6379/15"


def _config(url: str, prefix: str, fail_mode: str) -> Any:
    return parse_serve_config({
        "server": {"ratelimit": {"backend": "redis", "redis_url": url, "key_prefix": prefix,
                                 "fail_mode": fail_mode, "redis_timeout_s": 0.5}},
        "tenants": {"t": {"api_keys": ["sk-t"], "requests_per_s": 0.001, "request_burst": 3}},
    })  # fmt: skip


def _post(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=BODY, headers={"authorization": "Bearer sk-t"})


def _redis_or_skip() -> Any:
    """A client of the test Redis; the test is skipped where none answers."""
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=0.2)
    try:
        client.ping()
    except (redis.RedisError, OSError):
        pytest.skip(NO_REDIS)
    return client


def test_two_replicas_share_one_tenant_bucket_through_redis() -> None:
    _redis_or_skip()
    prefix = f"tierserve-test-{uuid.uuid4().hex}"
    with (
        live_server(make_state(_config(REDIS_URL, prefix, "closed"))) as a,
        live_server(make_state(_config(REDIS_URL, prefix, "closed"))) as b,
    ):
        codes = [_post(url).status_code for url in (a.url, b.url, a.url, b.url, a.url)]
        assert codes == [200, 200, 200, 429, 429]
        assert "tierserve_ratelimit_redis_up 1.0" in httpx.get(b.url + "/metrics").text


@pytest.mark.parametrize(("fail_mode", "status"), [("open", 200), ("closed", 503)])
def test_unreachable_redis_follows_the_fail_rule_and_says_so(fail_mode: str, status: int) -> None:
    state = make_state(_config("redis://127.0.0.1:1/0", "x", fail_mode))
    with live_server(state) as srv:
        r = _post(srv.url)
        assert r.status_code == status, r.text
        if status == 503:
            assert r.json()["error"]["code"] == "ratelimit_unavailable"
        metrics = httpx.get(srv.url + "/metrics").text
        assert "tierserve_ratelimit_redis_up 0.0" in metrics
        assert "tierserve_ratelimit_fallback_total 1.0" in metrics


def test_a_bucket_key_of_another_type_starts_over_and_redis_stays_up() -> None:
    """A key under the prefix that is not a bucket's hash made every script fail with
    WRONGTYPE, which read as Redis down: every tenant fell to the fail rule (here: 503)."""
    client = _redis_or_skip()
    prefix = f"tierserve-test-{uuid.uuid4().hex}"
    with live_server(make_state(_config(REDIS_URL, prefix, "closed"))) as srv:
        assert _post(srv.url).status_code == 200
        keys = [k.decode() for k in client.scan_iter(f"{prefix}:bucket:*")]
        assert keys
        for key in keys:
            client.delete(key)
            client.set(key, "not a bucket")
        codes = [_post(srv.url).status_code for _ in range(4)]
        metrics = httpx.get(srv.url + "/metrics").text
    assert codes == [200, 200, 200, 429]  # a full bucket of 3 again, then the limit
    assert "tierserve_ratelimit_redis_up 1.0" in metrics


def test_a_bucket_that_refills_over_centuries_still_works_through_redis() -> None:
    """Its expiry (the time to refill, + 60 s) was past what Redis accepts: every take failed
    with "invalid expire time", which read as Redis down, for every tenant (here: 503)."""
    _redis_or_skip()
    prefix = f"tierserve-test-{uuid.uuid4().hex}"
    config = parse_serve_config({
        "server": {"ratelimit": {"backend": "redis", "redis_url": REDIS_URL, "key_prefix": prefix,
                                 "fail_mode": "closed", "redis_timeout_s": 0.5}},
        "tenants": {"t": {"api_keys": ["sk-t"], "requests_per_s": 1e-13, "request_burst": 2}},
    })  # fmt: skip
    with live_server(make_state(config)) as srv:
        codes = [_post(srv.url).status_code for _ in range(3)]
        metrics = httpx.get(srv.url + "/metrics").text
    assert codes == [200, 200, 429]
    assert "tierserve_ratelimit_redis_up 1.0" in metrics


def test_redis_unreachable_at_start_up_is_said_before_any_request(caplog: pytest.LogCaptureFixture) -> None:
    """The gauge read 1 and the log said nothing until the first request met the outage."""
    caplog.set_level("WARNING", logger="tierserve.ratelimit")
    state = make_state(_config("redis://:secret@127.0.0.1:1/0", "x", "closed"))
    with live_server(state) as srv:
        metrics = httpx.get(srv.url + "/metrics").text
    assert "tierserve_ratelimit_redis_up 0.0" in metrics
    lines = [r.getMessage() for r in caplog.records if "unreachable at start-up" in r.getMessage()]
    assert len(lines) == 1
    assert "127.0.0.1:1" in lines[0] and "secret" not in lines[0]
    assert "Error" in lines[0] and "fail_mode closed" in lines[0]  # the error and the rule


def test_a_burst_past_the_connection_pool_waits_for_a_connection_not_for_redis_to_come_back() -> None:
    """redis-py's default pool refused the 101st concurrent command (MaxConnectionsError, a
    ConnectionError): a burst of 200 requests found a healthy Redis "unreachable", and a
    fail-closed server refused 195 of 210."""
    import asyncio

    from tierserve.server.buckets import Bucket
    from tierserve.server.redis_buckets import RedisBuckets

    _redis_or_skip()
    prefix = f"tierserve-test-{uuid.uuid4().hex}"

    async def burst() -> list[bool]:
        backend = RedisBuckets(REDIS_URL, timeout_s=0.5, key_prefix=prefix)
        try:
            bucket = Bucket("t:requests", 1000.0, 1000.0)
            results = await asyncio.gather(*(backend.take([bucket], [1.0]) for _ in range(250)))
            return [r.allowed for r in results]
        finally:
            await backend.close()

    assert asyncio.run(burst()) == [True] * 250


def test_a_take_redis_answers_ends_the_outage_a_concurrent_failure_began() -> None:
    """After one take failed and a concurrent one succeeded, /metrics said Redis was up but
    every decision fell back (here: refused, fail-closed) for the rest of the second."""
    import asyncio

    from tierserve.server.buckets import BucketLevel, TakeResult
    from tierserve.server.config import RateLimit, TenantConfig
    from tierserve.server.ratelimit import RateLimiter

    class Remote:
        num_takes = 0

        async def take(self, buckets: Any, costs: Any) -> TakeResult:
            self.num_takes += 1
            if self.num_takes == 1:
                await asyncio.sleep(0.005)
                raise ConnectionError("one connection broke")
            await asyncio.sleep(0.01)
            return TakeResult(True, tuple(BucketLevel(100.0, 0.0) for _ in buckets))

        async def give(self, bucket: Any, amount: float) -> None:
            return None

    async def run() -> tuple[bool, bool]:
        limiter = RateLimiter(RateLimit(requests_per_s=100), remote=Remote(), fail_open=False)
        tenant = TenantConfig("t")
        await asyncio.gather(limiter.acquire(tenant, 1), limiter.acquire(tenant, 1))
        after = await limiter.acquire(tenant, 1)
        return bool(limiter.redis_up), after.allowed

    assert asyncio.run(run()) == (True, True)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("redis://127.0.0.1:6379/abc", "database"),
        ("redis://127.0.0.1:6379/\u00b2", "database"),  # a digit to str.isdigit, not to redis-py
        ("redis://127.0.0.1:6379?db=abc", "database"),
        ("redis://127.0.0.1:notaport/0", "port"),
        ("redis://127.0.0.1:99999/0", "1 to 65535"),
        ("redis://127.0.0.1:0/9", "1 to 65535"),  # redis-py connected to 6379
        ("redis://[::1:6379/0", "not a valid URL"),
        ("redis://127.0.0.1:6379/9?foo=bar", "'foo' is not taken"),  # every request a 500
        ("redis://127.0.0.1:6379/9?socket_timeout=30", "redis_timeout_s"),  # overrode it
        ("unix:///tmp/redis.sock?db=abc", "database"),
    ],
)
def test_a_redis_url_with_a_bad_database_or_port_is_refused_naming_the_setting(url: str, said: str) -> None:
    """redis-py read database "abc" as 0 (sharing whatever else uses it), and a bad port
    failed at start-up without naming the setting."""
    from tierserve.config import ConfigError

    with pytest.raises(ConfigError, match=rf"server\.ratelimit\.redis_url: .*{re.escape(said)}"):
        _config(url, "x", "closed")


@pytest.mark.parametrize(
    "url",
    [
        "rediss://user:pass@cache.internal:6380/2",
        "redis://:p%40ss@127.0.0.1/0",
        "redis://[::1]:6379/0",
        "redis://127.0.0.1:6379?db=3",
        "redis://127.0.0.1:6379/0?ssl_cert_reqs=none",
        "unix:///tmp/redis.sock?db=3",
        "redis://cache",
    ],
)
def test_the_redis_url_forms_redis_py_reads_are_accepted(url: str) -> None:
    assert _config(url, "x", "closed").server.ratelimit.redis_url == url


def test_a_redis_slow_by_turns_is_said_once_not_at_every_turn(caplog: pytest.LogCaptureFixture) -> None:
    """Each answer ended the outage and each timeout began another, each with its WARNING
    line: a Redis slow by turns wrote 34 lines a second."""
    import asyncio

    from tierserve.server.buckets import BucketLevel, TakeResult
    from tierserve.server.config import RateLimit, TenantConfig
    from tierserve.server.ratelimit import RateLimiter

    clock = [0.0]

    class SlowByTurns:
        num_takes = 0

        async def take(self, buckets: Any, costs: Any) -> TakeResult:
            self.num_takes += 1
            if self.num_takes % 2:
                raise TimeoutError
            return TakeResult(True, tuple(BucketLevel(100.0, 0.0) for _ in buckets))

        async def give(self, bucket: Any, amount: float) -> None:
            return None

    async def run() -> None:
        limiter = RateLimiter(RateLimit(requests_per_s=1000), remote=SlowByTurns(), now=lambda: clock[0])
        for _ in range(40):  # 8 s of decisions, Redis down and back at every other one
            await limiter.acquire(TenantConfig("t"), 1)
            clock[0] += 1.1  # past the 1 s retry pause
            await limiter.acquire(TenantConfig("t"), 1)
            clock[0] += 0.1

    with caplog.at_level(logging.WARNING, logger="tierserve.ratelimit"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.name == "tierserve.ratelimit"]
    assert sum("unreachable" in line for line in lines) <= 6 and sum("back" in line for line in lines) <= 6
    assert any("unreachable" in line for line in lines)  # said, still


def test_an_outage_that_begins_inside_the_quiet_after_the_last_is_said_once_it_ends() -> None:
    """The line was written only as Redis went from up to down: an outage that began within
    10 s of the last line was never said, however long it lasted, and the log's last word
    was "limits are global again"."""
    import asyncio

    from tierserve.server.buckets import BucketLevel, TakeResult
    from tierserve.server.config import RateLimit, TenantConfig
    from tierserve.server.ratelimit import RateLimiter

    clock = [0.0]
    down = [True]

    class Flaky:
        async def take(self, buckets: Any, costs: Any) -> TakeResult:
            if down[0]:
                raise ConnectionError("refused")
            return TakeResult(True, tuple(BucketLevel(100.0, 0.0) for _ in buckets))

        async def give(self, bucket: Any, amount: float) -> None:
            return None

    said: list[tuple[float, str]] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append((clock[0], record.getMessage()))

    handler = Record(logging.WARNING)
    logging.getLogger("tierserve.ratelimit").addHandler(handler)
    try:

        async def run() -> None:
            limiter = RateLimiter(RateLimit(requests_per_s=1000), remote=Flaky(), now=lambda: clock[0])
            for t in range(60):  # down 0-1 s, up 2-3 s, down from 4 s on
                clock[0] = float(t) * 1.01
                down[0] = not 2 <= t <= 3
                await limiter.acquire(TenantConfig("t"), 1)

        asyncio.run(run())
    finally:
        logging.getLogger("tierserve.ratelimit").removeHandler(handler)
    assert [m.split(" (")[0].split(":")[0] for _, m in said] == [
        "rate-limit Redis unreachable",
        "rate-limit Redis is back",
        "rate-limit Redis unreachable",
    ]
    assert said[-1][0] >= 10.0  # the second outage, said once the quiet ended
