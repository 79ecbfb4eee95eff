"""Tenants, entitlement and rate limits through the live API."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.server.helpers import HEADERS_SENT_TWICE, MODEL, LiveServer, live_server, make_state
from tierserve.server.config import parse_serve_config

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CONFIG = {
    "server": {"tenant_header": True},
    "tenants": {
        "gold": {"api_keys": ["sk-gold"], "max_tier": "realtime", "default_tier": "realtime"},
        "bronze": {"api_keys": ["sk-bronze"], "max_tier": "batch", "default_tier": "background"},
        "tiny": {
            "api_keys": ["sk-tiny"],
            "max_tier": "P0",
            "requests_per_s": 0.01,
            "request_burst": 1,
            "tokens_per_s": 1,
            "token_burst": 5000,
        },
        "narrow": {"api_keys": ["sk-narrow"], "max_tier": "P0", "tokens_per_s": 10000, "token_burst": 300},
        "internal": {"max_tier": "online"},
    },
}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(make_state(parse_serve_config(CONFIG))) as srv:
        yield srv


def _client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def _tier(client: openai.OpenAI, **kw: object) -> str:
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kw)  # type: ignore[call-overload]
    return str(raw.headers["x-tierserve-tier"])


def test_key_selects_the_tenant_and_its_default_tier(server: LiveServer) -> None:
    assert _tier(_client(server, "sk-gold")) == "P0"
    assert _tier(_client(server, "sk-bronze")) == "P3"


def test_declared_tier_above_the_entitlement_is_lowered_never_raised(server: LiveServer) -> None:
    bronze = _client(server, "sk-bronze")
    assert _tier(bronze, extra_headers={"x-request-tier": "realtime"}) == "P2"
    assert _tier(bronze, extra_body={"priority": 0}) == "P2"
    assert _tier(bronze, extra_headers={"x-request-tier": "background"}) == "P3"
    gold = _client(server, "sk-gold")
    assert _tier(gold, extra_headers={"x-request-tier": "batch"}) == "P2"
    text = httpx.get(server.url + "/metrics").text
    assert 'tierserve_requests_total{finish_reason="length",priority="P2"}' in text


@pytest.mark.parametrize("key", ["sk-wrong", ""])
def test_unknown_or_missing_key_is_401(server: LiveServer, key: str) -> None:
    if key:
        with pytest.raises(openai.AuthenticationError) as e:
            _client(server, key).chat.completions.create(model=MODEL, messages=MESSAGES)
        assert e.value.code == "invalid_api_key"
    else:
        r = httpx.post(server.base_url + "/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_listing_models_needs_a_key_too(server: LiveServer) -> None:
    assert [m.id for m in _client(server, "sk-bronze").models.list()] == [MODEL]
    with pytest.raises(openai.AuthenticationError):
        _client(server, "sk-wrong").models.list()
    r = httpx.get(server.base_url + "/models")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/models", headers={"x-tenant-id": "internal"}).status_code == 200


def test_tenant_header_is_accepted_where_the_config_allows_it(server: LiveServer) -> None:
    r = httpx.post(
        server.base_url + "/chat/completions",
        headers={"x-tenant-id": "internal", "x-request-tier": "P0"},
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
    )
    assert r.status_code == 200 and r.headers["x-tierserve-tier"] == "P1"
    r = httpx.post(
        server.base_url + "/chat/completions",
        headers={"x-tenant-id": "nobody"},
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
    )
    assert r.status_code == 401


def test_over_the_rate_limit_is_429_with_openai_headers(server: LiveServer) -> None:
    tiny = _client(server, "sk-tiny")
    raw = tiny.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert raw.headers["x-ratelimit-limit-requests"] == "1"
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"
    assert raw.headers["x-ratelimit-limit-tokens"] == "5000"
    with pytest.raises(openai.RateLimitError) as e:
        tiny.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    headers = e.value.response.headers
    assert int(headers["retry-after"]) >= 60  # one request per 100 s
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"].endswith("s")
    for name in ("limit", "remaining", "reset"):
        assert f"x-ratelimit-{name}-tokens" in headers
    body = e.value.response.json()["error"]
    assert body["code"] == "rate_limit_exceeded" and body["type"] == "requests"
    text = httpx.get(server.url + "/metrics").text
    # Refused before its body was read: no tier is known yet.
    assert 'tierserve_rejections_total{priority="none",reason="rate_limit_requests"} 1.0' in text


def test_request_too_large_for_the_token_bucket_is_400_naming_max_tokens(server: LiveServer) -> None:
    r = httpx.post(
        server.base_url + "/chat/completions",
        headers={"authorization": "Bearer sk-narrow"},
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 6000},
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "max_tokens" and "at most 300" in error["message"]
    assert error["code"] == "tokens_exceed_burst" and "retry-after" not in r.headers


def test_a_request_without_max_tokens_fits_a_burst_below_the_default_output(server: LiveServer) -> None:
    """token_burst = 300 < the default 512 output tokens: a request without max_tokens was a
    429 "too large" with no Retry-After, every time, and the OpenAI SDK retried it anyway."""
    narrow = _client(server, "sk-narrow")
    usage = narrow.chat.completions.create(model=MODEL, messages=MESSAGES).usage
    assert usage is not None and usage.completion_tokens > 300  # settled to the real count
    with pytest.raises(openai.BadRequestError) as e:
        narrow.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=400)
    assert e.value.param == "max_completion_tokens" and "token_burst" in e.value.message
    long_prompt: list[ChatCompletionMessageParam] = [{"role": "user", "content": "x" * 400}]
    with pytest.raises(openai.BadRequestError) as e:
        narrow.chat.completions.create(model=MODEL, messages=long_prompt)
    assert e.value.param == "messages" and "at most 300" in e.value.message


@pytest.mark.parametrize(("name", "first", "second", "key"), HEADERS_SENT_TWICE)
def test_a_header_sent_twice_with_different_values_is_400_naming_it(
    server: LiveServer, name: str, first: str, second: str, key: str | None
) -> None:
    """The first one won, silently: whoever added the second meant something else."""
    auth = [] if key is None else [("authorization", f"Bearer {key}")]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    chat = server.base_url + "/chat/completions"
    r = httpx.post(chat, json=body, headers=[*auth, (name, first), (name, second)])
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == name and "different values" in error["message"]
    if name != "x-request-tier":  # the model list reads no tier
        r = httpx.get(server.base_url + "/models", headers=[*auth, (name, first), (name, second)])
        assert r.status_code == 400 and r.json()["error"]["param"] == name
    same = httpx.post(chat, json=body, headers=[*auth, (name, first), (name, first)])
    assert same.status_code == 200  # the same value twice is no ambiguity


def test_one_tier_spelled_twice_is_that_tier(server: LiveServer) -> None:
    """`P3` and `p3` (or `background`) from a client and a proxy name one tier: a 400 for
    "different values" was a refusal for nothing."""
    auth = [("authorization", "Bearer sk-bronze")]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
    for second in ("p3", "background"):
        tiers = [("x-request-tier", "P3"), ("x-request-tier", second)]
        r = httpx.post(server.base_url + "/chat/completions", json=body, headers=[*auth, *tiers])
        assert r.status_code == 200 and r.headers["x-tierserve-tier"] == "P3", r.text


def test_refusals_before_the_application_takes_a_request_are_counted() -> None:
    """A wrong key, a compressed body, a body over the limit, a trailing slash and a key sent
    twice were answered and counted nowhere (the docs said each one is)."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}
    key = {"authorization": "Bearer sk-gold"}
    twice = [("authorization", "Bearer sk-gold"), ("authorization", "Bearer sk-bronze")]
    with live_server(make_state(parse_serve_config(CONFIG))) as srv:
        url = srv.base_url + "/chat/completions"
        sent = [
            httpx.post(url, json=body, headers={"authorization": "Bearer sk-guess"}, timeout=30),
            httpx.post(url, content=b"x", headers={**key, "content-encoding": "gzip"}, timeout=30),
            httpx.post(url, content=b"x" * (2 << 20), headers=key, timeout=30),
            httpx.post(url + "/", json=body, headers=key, timeout=30),
            httpx.post(url, json=body, headers=twice, timeout=30),
        ]
        metrics = httpx.get(srv.url + "/metrics", timeout=30).text
    assert [r.status_code for r in sent] == [401, 415, 413, 404, 400]
    reasons = (
        "invalid_api_key",
        "unsupported_content_encoding",
        "request_too_large",
        "not_found",
        "bad_header",
    )
    for reason in reasons:
        assert f'tierserve_http_errors_total{{reason="{reason}"}} 1.0' in metrics, reason
