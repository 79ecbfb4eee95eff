"""Real processes: three `tierserve serve --backend sim` upstreams behind two gateways.

Limits are shared through the Redis on 127.0.0.1:6379 (a key prefix of this run's own);
the Redis outage test starts and stops a redis-server of its own on a free port.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.gateway.procs import MODEL, Proc, start_gateway, start_redis, start_upstream, upstreams_toml

SHARED_REDIS = "redis://127.0.0.1:6379/14"
LIMIT_RPS, LIMIT_BURST = 4.0, 4.0
TENANTS = f"""
[tenants.limited]
api_keys = ["sk-limited"]
max_tier = "realtime"  # a tenant without max_tier runs at P3 (deny by default)
requests_per_s = {LIMIT_RPS}
request_burst = {LIMIT_BURST}

[tenants.batch]
api_keys = ["sk-batch"]
max_tier = "batch"
default_tier = "batch"

[tenants.free]
api_keys = ["sk-free"]
max_tier = "realtime"  # a tenant without max_tier runs at P3 (deny by default)
"""


def _chat(max_tokens: int = 2, stream: bool = False, text: str = "hi") -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _redis_or_skip() -> None:
    redis = pytest.importorskip("redis")
    try:
        redis.Redis.from_url(SHARED_REDIS, socket_connect_timeout=0.5).ping()
    except (redis.RedisError, OSError):
        pytest.skip("no Redis server on 127.0.0.1:6379")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Proc], list[Proc]]]:
    _redis_or_skip()
    tmp = tmp_path_factory.mktemp("fleet")
    ups: list[Proc] = []
    gws: list[Proc] = []
    try:
        ups.extend(start_upstream(tmp, f"u{i}") for i in range(3))
        config = f"""
[server.ratelimit]
backend = "redis"
redis_url = "{SHARED_REDIS}"
key_prefix = "tierserve-gw-test-{uuid.uuid4().hex}"
redis_timeout_s = 2.0
[gateway]
instances = 2
scrape_interval_s = 0.3
{TENANTS}{upstreams_toml(ups)}"""
        gws.extend(start_gateway(tmp, f"gw{i}", config) for i in range(2))
        yield ups, gws
    finally:
        for p in gws + ups:
            p.stop()


def test_a_tenants_global_limit_holds_across_two_gateways(fleet: tuple[list[Proc], list[Proc]]) -> None:
    _, gws = fleet
    headers = {"authorization": "Bearer sk-limited"}
    start = time.monotonic()
    deadline = start + 6.0

    def worker(i: int) -> list[tuple[float, int]]:
        sent: list[tuple[float, int]] = []  # (when it was sent, status)
        with httpx.Client(base_url=gws[i % 2].url, headers=headers, timeout=30) as client:
            while time.monotonic() < deadline and len(sent) < 300:
                at = time.monotonic()
                sent.append((at, client.post("/v1/chat/completions", json=_chat(1)).status_code))
        return sent

    with ThreadPoolExecutor(6) as pool:
        sent = [s for ss in pool.map(worker, range(6)) for s in ss]
    codes = [code for _, code in sent]
    # Buckets are debited when a request arrives: the window ends with the last one sent
    # (plus the time one decision takes, bounded here by one refill interval).
    window = max(at for at, _ in sent) - start + 1 / LIMIT_RPS
    allowed = LIMIT_BURST + LIMIT_RPS * window
    admitted = codes.count(200)
    assert set(codes) <= {200, 429}
    assert codes.count(429) > 0  # the load was over the limit
    assert admitted <= 1.05 * allowed, (admitted, allowed)
    # Not starved either (the bound is loose: on a busy host a 200 takes long enough that the
    # clients cannot take every token the bucket refills).
    assert admitted >= 0.5 * allowed, (admitted, allowed, len(codes))


def test_a_p2_tenant_never_gets_p0_treatment_through_any_gateway(
    fleet: tuple[list[Proc], list[Proc]],
) -> None:
    ups, gws = fleet
    before = [httpx.get(u.url + "/metrics").text for u in ups]
    asks = [{"x-request-tier": "P0"}, {"x-request-tier": "realtime"}, {}]
    n = 0
    for gw in gws:
        for extra in asks:
            body = {**_chat(1), "priority": 0}
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json=body,
                headers={"authorization": "Bearer sk-batch", **extra},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-tierserve-tier"] == "P2"
            n += 1

    def counted(tier: str, after: list[str]) -> float:
        return sum(
            _metric(a, "tierserve_requests_total", priority=tier)
            - _metric(b, "tierserve_requests_total", priority=tier)
            for a, b in zip(after, before, strict=True)
        )

    # A scrape while the gateway's own is in flight shows the last families the server had
    # (serving.md): read again, a bounded while, until the engines' counts are in.
    deadline = time.monotonic() + 10
    while True:
        after = [httpx.get(u.url + "/metrics").text for u in ups]
        if counted("P2", after) == n or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (counted("P0", after), counted("P2", after)) == (0, n)
    for gw in gws:
        assert (
            _metric(
                httpx.get(gw.url + "/metrics").text,
                "tierserve_gateway_routing_decisions_total",
                reason="p0_soonest",
            )
            == 0
        )


def _stream_outcome(url: str, i: int) -> str:
    """'done', 'error' (an explicit error: a status or an error event) or 'silent' (neither)."""
    body = _chat(48, stream=True, text=f"request {i} " * 3)
    try:
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json=body,
            headers={"authorization": "Bearer sk-free"},
            timeout=60,
        ) as r:
            if r.status_code != 200:
                r.read()
                return "error" if "error" in r.text else "silent"
            text = "".join(r.iter_text())
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError:
        return "silent"
    if '"error"' in text:
        return "error"
    return "done" if "data: [DONE]" in text and '"finish_reason": "length"' in text else "silent"


def test_an_upstream_killed_mid_load_costs_no_request_silently_and_is_taken_back(
    fleet: tuple[list[Proc], list[Proc]], tmp_path: Path
) -> None:
    ups, gws = fleet
    gw = gws[0]
    victim = ups[1]
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(_stream_outcome, gw.url, i) for i in range(24)]
        time.sleep(0.8)
        victim.stop(signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    assert set(outcomes) <= {"done", "error"}, outcomes
    assert outcomes.count("done") > 0
    # Routed around it: everything sent now completes.
    after = [_stream_outcome(gw.url, 100 + i) for i in range(6)]
    assert after == ["done"] * 6
    metrics = httpx.get(gw.url + "/metrics").text
    assert _metric(metrics, "tierserve_gateway_upstream_healthy", upstream="u1") == 0
    # Back on the same port: health checks re-admit it and it gets requests again.
    ups[1] = start_upstream(tmp_path, "u1-again", port=victim.port)
    deadline = time.monotonic() + 30
    while (
        _metric(httpx.get(gw.url + "/metrics").text, "tierserve_gateway_upstream_healthy", upstream="u1") != 1
    ):
        assert time.monotonic() < deadline, "u1 was not re-admitted"
        time.sleep(0.3)
    served = _metric(
        httpx.get(gw.url + "/metrics").text,
        "tierserve_gateway_upstream_requests_total",
        upstream="u1",
        outcome="ok",
    )
    for i in range(12):
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json=_chat(1, text=f"prefix {i}"),
            headers={"authorization": "Bearer sk-free"},
            timeout=30,
        )
        assert r.status_code == 200
    again = _metric(
        httpx.get(gw.url + "/metrics").text,
        "tierserve_gateway_upstream_requests_total",
        upstream="u1",
        outcome="ok",
    )
    assert again > served


def test_redis_stopped_and_restarted_each_tier_follows_its_rule_then_global_state_resumes(
    fleet: tuple[list[Proc], list[Proc]], tmp_path: Path
) -> None:
    ups, _ = fleet
    redis = start_redis(tmp_path, dump_dir=tmp_path)
    burst = 20
    config = f"""
[server.ratelimit]
backend = "redis"
redis_url = "redis://127.0.0.1:{redis.port}/0"
key_prefix = "gw-outage"
redis_timeout_s = 1.0
[gateway]
instances = 2
[gateway.redis_fail]
P1 = "open"
P2 = "closed"
[tenants.t]
api_keys = ["sk-t"]
max_tier = "realtime"  # a tenant without max_tier runs at P3 (deny by default)
requests_per_s = 0.001
request_burst = {burst}
[tenants.bg]
api_keys = ["sk-bg"]
max_tier = "realtime"  # a tenant without max_tier runs at P3 (deny by default)
requests_per_s = 1000
request_burst = 1000
{upstreams_toml(ups)}"""
    gw = start_gateway(tmp_path, "gw-outage", config)
    phase = ["before"]
    seen: list[tuple[str, str, int]] = []  # (phase, tier, status) of the background load

    def background() -> None:
        with httpx.Client(base_url=gw.url, headers={"authorization": "Bearer sk-bg"}, timeout=30) as client:
            for i in range(2000):
                if phase[0] == "done":
                    return
                tier, now = ("P1", "P2")[i % 2], phase[0]
                r = client.post("/v1/chat/completions", json=_chat(1), headers={"x-request-tier": tier})
                seen.append((now, tier, r.status_code))
                time.sleep(0.1)

    load = threading.Thread(target=background)
    load.start()
    try:

        def codes(tier: str, n: int) -> list[int]:
            h = {"authorization": "Bearer sk-t", "x-request-tier": tier}
            return [
                httpx.post(gw.url + "/v1/chat/completions", json=_chat(1), headers=h, timeout=30).status_code
                for _ in range(n)
            ]

        assert codes("P1", 5) == [200] * 5
        phase[0] = "down"
        redis.stop()
        p2 = codes("P2", 3)
        p1 = codes("P1", burst)
        assert p2 == [503] * 3  # fail closed
        assert p1.count(200) == burst // 2 and set(p1) == {200, 429}  # fail open on 1/2 of the burst
        metrics = httpx.get(gw.url + "/metrics").text
        assert _metric(metrics, "tierserve_ratelimit_redis_up") == 0
        assert _metric(metrics, "tierserve_gateway_redis_errors_total") >= 1
        assert "Redis unreachable" in gw.output()
        redis = start_redis(tmp_path, port=redis.port, dump_dir=tmp_path)
        time.sleep(1.5)  # the limiter retries Redis after REDIS_RETRY_S
        phase[0] = "after"
        resumed = codes("P2", burst)
        # The global bucket as Redis kept it: the burst less 5 taken before the outage (none during it).
        assert resumed.count(200) == burst - 5, resumed
        assert _metric(httpx.get(gw.url + "/metrics").text, "tierserve_ratelimit_redis_up") == 1
        assert "Redis is back" in gw.output()
        phase[0] = "done"
        load.join(60)
        # Under load all along: P1 never refused, P2 refused only while Redis was away.
        assert {status for _, tier, status in seen if tier == "P1"} == {200}
        assert {status for ph, tier, status in seen if tier == "P2" and ph != "down"} == {200}
        assert 503 in {status for ph, tier, status in seen if tier == "P2" and ph == "down"}
        assert {ph for ph, _, _ in seen} >= {"before", "down", "after"}
    finally:
        phase[0] = "done"
        load.join(60)
        gw.stop()
        redis.stop()
