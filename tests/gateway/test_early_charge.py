"""The gateway charges a request before reading its body, as `tierserve serve` does: a body
it then refuses keeps the charge, and a 429 for requests leaves the body unread."""

from __future__ import annotations

import httpx

from tests.gateway.fakes import FAKE_MODEL, FakeUpstream, fake_upstream, gateway

TENANTS = """
[tenants.few]
api_keys = ["sk-few"]
max_tier = "P0"
requests_per_s = 0.001
request_burst = 3
"""
HEADERS = {"authorization": "Bearer sk-few"}


def test_invalid_bodies_are_charged_and_a_429_for_requests_leaves_the_body_unread() -> None:
    valid = {"model": FAKE_MODEL, "prompt": "hi", "max_tokens": 2}
    with fake_upstream(FakeUpstream("ok")) as url, gateway([url], TENANTS) as (gw, _):
        post = gw.url + "/v1/completions"
        invalid = [httpx.post(post, json={**valid, "max_tokens": "many"}, headers=HEADERS) for _ in range(2)]
        served = httpx.post(post, json=valid, headers=HEADERS)
        refused = httpx.post(post, json=valid, headers=HEADERS)
        large = b'{"model": "m", "prompt": [' + b"1," * 50_000 + b"1]}"
        unread = httpx.post(post, content=large, headers={**HEADERS, "content-type": "application/json"})
        metrics = httpx.get(gw.url + "/metrics").text
    assert [r.status_code for r in invalid] == [400, 400]
    assert served.status_code == 200 and served.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
    assert unread.status_code == 429 and unread.headers["connection"] == "close"
    assert 'tierserve_rejections_total{priority="none",reason="rate_limit_requests"} 2.0' in metrics
