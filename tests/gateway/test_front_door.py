"""The gateway's own answers, before any upstream, as `tierserve serve` gives them
(tests/server/test_api.py, test_auth_and_limits.py): a request too large for a token
bucket, HEAD, a trailing slash, a tenant, tier or key header sent twice."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.fakes import FAKE_MODEL, FakeUpstream, Running, fake_upstream, gateway_of
from tests.server.helpers import HEADERS_SENT_TWICE, SLASHED_PATHS
from tierserve.gateway.config import parse_gateway_config

MESSAGES = [{"role": "user", "content": "hi"}]
CONFIG = """
[server]
tenant_header = true
[tenants.gold]
api_keys = ["sk-gold"]
max_tier = "P0"
[tenants.bronze]
api_keys = ["sk-bronze"]
max_tier = "batch"
default_tier = "background"
[tenants.narrow]
api_keys = ["sk-narrow"]
max_tier = "P0"
tokens_per_s = 10000
token_burst = 300
[tenants.internal]
max_tier = "online"
[gateway]
scrape_interval_s = 0.2
"""


@pytest.fixture(scope="module")
def front() -> Iterator[tuple[Running, FakeUpstream]]:
    """A gateway in front of one upstream of kind `tierserve` (the tier goes down as a header)."""
    fake = FakeUpstream("ok")
    with fake_upstream(fake) as url:
        ups = f'[[upstreams]]\nname = "t0"\nkind = "tierserve"\nurl = "{url}"\n'
        with gateway_of(parse_gateway_config(tomllib.loads(CONFIG + ups))) as (running, _):
            yield running, fake


def _post(
    gw: Running, body: dict[str, object], headers: list[tuple[str, str]], path: str = "/v1/chat/completions"
) -> httpx.Response:
    return httpx.post(gw.url + path, json={"model": FAKE_MODEL, **body}, headers=headers, timeout=30)


def test_a_request_without_max_tokens_fits_a_burst_below_the_default_output(
    front: tuple[Running, FakeUpstream],
) -> None:
    """token_burst = 300 < the default 512 output tokens: a request without max_tokens was
    refused every time (a 400 with `param` null), though it fits once its default output is cut."""
    gw, fake = front
    narrow = [("authorization", "Bearer sk-narrow")]
    assert _post(gw, {"messages": MESSAGES}, narrow).status_code == 200
    num_sent = len(fake.bodies)
    for field in ("max_tokens", "max_completion_tokens"):
        r = _post(gw, {"messages": MESSAGES, field: 400}, narrow)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "tokens_exceed_burst", r.text
        assert error["param"] == field and "at most 300" in error["message"]
        assert "retry-after" not in r.headers
    long = "x" * 1400  # about 350 tokens by the gateway's estimate
    r = _post(gw, {"messages": [{"role": "user", "content": long}]}, narrow)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    r = _post(gw, {"prompt": long}, narrow, path="/v1/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert len(fake.bodies) == num_sent  # none of them reached the upstream


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/v1/models"])
def test_head_is_answered_as_get_without_a_body(front: tuple[Running, FakeUpstream], path: str) -> None:
    """Load balancers probe with HEAD; every GET route answered it 405."""
    gw, _ = front
    key = {"authorization": "Bearer sk-gold"}
    got, head = httpx.get(gw.url + path, headers=key), httpx.head(gw.url + path, headers=key)
    assert head.status_code == got.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    if path != "/metrics":  # the same length: a body that does not change between the two
        assert head.headers["content-length"] == got.headers["content-length"]
    assert httpx.head(gw.url + "/v1/completions", headers=key).status_code == 405  # POST only, as GET


@pytest.mark.parametrize(("method", "path"), SLASHED_PATHS)
def test_a_trailing_slash_is_a_404_not_a_redirect_to_the_host_header(
    front: tuple[Running, FakeUpstream], method: str, path: str
) -> None:
    """Starlette redirected (307) to a Location built from the client's Host header."""
    gw, _ = front
    body = {"model": FAKE_MODEL, "messages": MESSAGES, "max_tokens": 2}
    headers = {"host": "evil.example", "authorization": "Bearer sk-gold"}
    r = httpx.request(method, gw.url + path, json=body, headers=headers)
    assert r.status_code == 404 and "location" not in r.headers
    assert r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(("name", "first", "second", "key"), HEADERS_SENT_TWICE)
def test_a_header_sent_twice_with_different_values_is_400_naming_it(
    front: tuple[Running, FakeUpstream], name: str, first: str, second: str, key: str | None
) -> None:
    """The first one won, silently, and went on to the upstream as the request's tier."""
    gw, fake = front
    auth = [] if key is None else [("authorization", f"Bearer {key}")]
    body = {"messages": MESSAGES, "max_tokens": 2}
    num_sent = len(fake.bodies)
    r = _post(gw, body, [*auth, (name, first), (name, second)])
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == name and "different values" in error["message"]
    assert len(fake.bodies) == num_sent  # nothing reached the upstream
    if name != "x-request-tier":  # the model list reads no tier
        r = httpx.get(gw.url + "/v1/models", headers=[*auth, (name, first), (name, second)])
        assert r.status_code == 400 and r.json()["error"]["param"] == name
    same = _post(gw, body, [*auth, (name, first), (name, first)])
    assert same.status_code == 200, same.text  # the same value twice is no ambiguity
    assert len(fake.tiers[-1]) == 1  # the upstream hears the tier once, the gateway's own header
    if name == "x-request-tier":
        assert fake.tiers[-1] == [same.headers["x-tierserve-tier"]] == ["P3"]


def test_each_tenant_gets_a_cache_salt_of_its_own_on_the_upstream(
    front: tuple[Running, FakeUpstream],
) -> None:
    """An upstream sees one caller, the gateway: its tenants shared each upstream's prefix
    cache, and one tenant's cached_tokens told it which prompts another had sent."""
    gw, fake = front

    def salt_sent(headers: list[tuple[str, str]], **body: object) -> object:
        assert _post(gw, {"messages": MESSAGES, "max_tokens": 2, **body}, headers).status_code == 200
        return fake.bodies[-1].get("cache_salt")

    gold, bronze = [("authorization", "Bearer sk-gold")], [("authorization", "Bearer sk-bronze")]
    salts = [
        salt_sent(gold),
        salt_sent(bronze),
        salt_sent(gold, cache_salt="s1"),
        salt_sent(bronze, cache_salt="s1"),
    ]
    assert len(set(salts)) == 4  # type: ignore[arg-type]
    assert all(isinstance(s, str) and len(s) == 64 and int(s, 16) >= 0 for s in salts)  # vLLM takes it
    assert salt_sent(gold) == salts[0]  # a tenant's own requests share their blocks


def test_metrics_scrapes_in_a_loop_are_rendered_once_per_age() -> None:
    """No key guards /metrics, and each render took milliseconds on the loop that relays the
    streams: scrapes within `[server] metrics_max_age_s` get the last exposition."""
    with fake_upstream(FakeUpstream("ok")) as url:
        ups = f'[[upstreams]]\nname = "t0"\nkind = "vllm"\nurl = "{url}"\n'
        config = parse_gateway_config(tomllib.loads("[server]\nmetrics_max_age_s = 60\n" + ups))
        with gateway_of(config, fresh_metrics=False) as (running, gw):
            render = gw.metrics.render
            renders = []

            def counted() -> bytes:
                renders.append(1)
                return render()

            gw.metrics.render = counted  # type: ignore[method-assign]
            bodies = {httpx.get(running.url + "/metrics", timeout=30).text for _ in range(20)}
    assert len(renders) == 1 and len(bodies) == 1
