"""A request is charged one request as soon as its key is known, before its body is read:
a body that is then refused keeps the charge, and a request the server runs is charged once.

An attack trial: a tenant allowed 5 requests a second sent 58 a second of 63 KB bodies that
failed validation (each 25-36 ms of the event loop before its 400), never charged, and
another tenant's P0 stream fell from 96 to 15 chunks a second.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.server.helpers import MODEL, LiveServer, live_server, make_state
from tierserve.server.config import parse_serve_config

# Request buckets that do not refill within a test (one request per 1,000 s).
CONFIG = {
    "tenants": {
        "few": {"api_keys": ["sk-few"], "max_tier": "P0", "requests_per_s": 0.001, "request_burst": 3},
        "metered": {
            "api_keys": ["sk-metered"],
            "max_tier": "P0",
            "requests_per_s": 0.001,
            "request_burst": 5,
            "tokens_per_s": 0.001,
            "token_burst": 1000,
        },
        "chatty": {"api_keys": ["sk-chatty"], "max_tier": "P0", "requests_per_s": 0.001, "request_burst": 3},
    },
}
VALID = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(make_state(parse_serve_config(CONFIG))) as srv:
        yield srv


def _post(server: LiveServer, key: str, body: bytes | dict[str, object]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    return httpx.post(server.base_url + "/chat/completions", content=content, headers=headers, timeout=30)


def test_invalid_bodies_are_charged_so_the_request_rate_bounds_them(server: LiveServer) -> None:
    invalid = {**VALID, "max_tokens": "many"}
    answers = [_post(server, "sk-few", invalid).status_code for _ in range(3)]
    assert answers == [400, 400, 400]
    refused = _post(server, "sk-few", VALID)  # valid, but the three 400s spent the burst
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "requests"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_a_429_for_requests_comes_before_the_body_is_read_or_parsed(server: LiveServer) -> None:
    for _ in range(3):
        assert _post(server, "sk-chatty", VALID).status_code == 200
    not_json = _post(server, "sk-chatty", b"{not json")  # parsed, it would be a 400
    assert not_json.status_code == 429 and not_json.json()["error"]["code"] == "rate_limit_exceeded"
    large = _post(server, "sk-chatty", b'{"model": "m", "prompt": [' + b"1," * 50_000 + b"1]}")
    assert large.status_code == 429 and large.headers["connection"] == "close"  # left unread
    metrics = httpx.get(server.url + "/metrics").text
    assert 'tierserve_rejections_total{priority="none",reason="rate_limit_requests"}' in metrics


def test_each_request_is_charged_once_whatever_its_answer(server: LiveServer) -> None:
    """Served, or refused later for its tokens, a request costs one request: the token
    buckets' charge does not take another."""
    remaining = []
    served = _post(server, "sk-metered", VALID)
    remaining.append(served.headers["x-ratelimit-remaining-requests"])
    too_large = _post(server, "sk-metered", {**VALID, "max_tokens": 5000})  # past the token burst
    assert too_large.status_code == 400 and too_large.json()["error"]["code"] == "tokens_exceed_burst"
    remaining.append(too_large.headers["x-ratelimit-remaining-requests"])
    served = _post(server, "sk-metered", VALID)
    assert served.status_code == 200
    remaining.append(served.headers["x-ratelimit-remaining-requests"])
    assert remaining == ["4", "3", "2"]
    assert served.headers["x-ratelimit-limit-tokens"] == "1000"  # the token buckets' headers too


def test_a_chat_with_more_messages_than_the_cap_is_a_400_naming_the_setting() -> None:
    config = parse_serve_config({"server": {"max_chat_messages": 4}})
    with live_server(make_state(config)) as srv:
        body = {**VALID, "messages": [{"role": "user", "content": "hi"}] * 5}
        refused = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=30)
        fits = httpx.post(srv.base_url + "/chat/completions", json={**body, "messages": body["messages"][:4]})
    error = refused.json()["error"]
    assert refused.status_code == 400 and error["param"] == "messages"
    assert "at most 4 messages" in error["message"] and "server.max_chat_messages" in error["message"]
    assert fits.status_code == 200
