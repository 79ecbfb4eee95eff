"""Per-tenant state in the server is bounded by the declared tenants, whatever tenant ids
clients send: 50,000 one-off `x-tenant-id`s leave no bucket, no metric label set and no
dict entry behind. (The engine's fair queue is covered in tests/scheduling.)"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.server.helpers import MODEL, live_server, make_state
from tierserve.server.config import ServeConfig, parse_serve_config
from tierserve.server.metrics import ServerMetrics
from tierserve.server.ratelimit import RateLimiter
from tierserve.server.tenants import TenantResolver, decide_tier
from tierserve.tiers import ALL_TIERS

NUM_TENANTS = 50_000
LIMITED = {
    "server": {"allow_anonymous": True},
    "limits": {"requests_per_s": 1e9},
    "tenants": {
        "default": {"requests_per_s": 1e9, "tokens_per_s": 1e12, "max_tier": "P1"},
        "gold": {"api_keys": ["sk-gold"], "requests_per_s": 1e9, "max_tier": "P0"},
    },
}


def _footprint(limiter: RateLimiter, metrics: ServerMetrics) -> tuple[int, int, int]:
    samples = sum(len(family.samples) for family in metrics.registry.collect())
    return len(limiter._tenant_buckets), len(limiter._local._state), samples


def _serve_one_offs(config: ServeConfig, n: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    resolver = TenantResolver(config)
    limiter = RateLimiter(config.limits.global_limit)
    metrics = ServerMetrics(MODEL, {t: 1.0 for t in ALL_TIERS})

    async def one(i: int) -> None:
        tenant = resolver.resolve(None, f"one-off-{i}")
        tier = decide_tier(tenant, None).effective
        decision = await limiter.acquire(tenant, 10)
        assert decision.allowed
        await limiter.settle(decision.reservation, 5)
        metrics.observe_first_token(tier, 0.01, 10)
        metrics.observe_finished(tier, tenant.max_tier, 0.01, 0.02, "stop")

    async def run(lo: int, hi: int) -> tuple[int, int, int]:
        for i in range(lo, hi):
            await one(i)
        return _footprint(limiter, metrics)

    early = asyncio.run(run(0, 100))
    late = asyncio.run(run(100, n))
    return early, late


def test_one_off_tenant_ids_leave_nothing_behind_on_an_open_server() -> None:
    early, late = _serve_one_offs(ServeConfig(), NUM_TENANTS)
    assert late == early


def test_one_off_tenant_ids_leave_nothing_behind_beside_limited_tenants() -> None:
    early, late = _serve_one_offs(parse_serve_config(LIMITED), NUM_TENANTS)
    assert late == early
    assert early[0] == 1  # the anonymous (default) tenant's buckets, shared by every one-off id


def test_one_off_tenant_ids_through_the_api_do_not_grow_the_metrics_or_the_limiter() -> None:
    state = make_state(parse_serve_config(LIMITED))

    def scrape(client: httpx.Client, lo: int, hi: int) -> tuple[Any, ...]:
        for i in range(lo, hi):
            r = client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                headers={"x-tenant-id": f"one-off-{i}"},
            )
            assert r.status_code == 200, r.text
        lines = [line for line in client.get("/metrics").text.splitlines() if not line.startswith("#")]
        return len(lines), len(state.limiter._tenant_buckets), len(state.limiter._local._state)

    with live_server(state) as srv, httpx.Client(base_url=srv.url, timeout=30) as client:
        early = scrape(client, 0, 20)
        late = scrape(client, 20, 400)
    assert late == early
