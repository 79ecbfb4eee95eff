"""Upstreams that fail in ways their health checks do not show, and what each request costs
its tenant's token bucket, against fake upstreams."""

from __future__ import annotations

import threading
import time
import tomllib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from tests.gateway.fakes import (
    FAKE_MODEL,
    FakeUpstream,
    Running,
    fake_upstream,
    gateway,
    gateway_of,
    metric_counts,
)
from tierserve.gateway import poller
from tierserve.gateway.config import parse_gateway_config
from tierserve.gateway.state import GatewayState
from tierserve.server.ratelimit import Reservation

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}
TENANT = """
[tenants.a]
api_keys = ["sk-a"]
tokens_per_s = 1
token_burst = 4000
[gateway]
scrape_interval_s = 0.2
"""


@contextmanager
def _keyed_gateway(fake: FakeUpstream) -> Iterator[tuple[Running, GatewayState, list[tuple[int, int]]]]:
    """A gateway with tenant `a` in front of `fake`, and every settlement it makes, as
    (id of the reservation, tokens used)."""
    with fake_upstream(fake) as url:
        ups = f'[[upstreams]]\nname = "f0"\nkind = "vllm"\nurl = "{url}"\n'
        with gateway_of(parse_gateway_config(tomllib.loads(TENANT + ups))) as (running, gw):
            settled: list[tuple[int, int]] = []
            settle = gw.limiter.settle

            async def recording(reservation: Reservation | None, used: int) -> None:
                if reservation is not None:
                    settled.append((id(reservation), used))
                await settle(reservation, used)

            gw.limiter.settle = recording  # type: ignore[method-assign]
            yield running, gw, settled


def _post(gw: Running, **fields: object) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/chat/completions",
        json={**CHAT, **fields},
        headers={"Authorization": "Bearer sk-a"},
        timeout=30,
    )


def _wait_for(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)


@pytest.mark.parametrize("status", [400, 422, 429])
@pytest.mark.parametrize(
    "body", [b'{"detail": "no"}', b"<html>no</html>", b'{"error": {"message": "no"}}'], ids=str
)
def test_a_refusal_passed_on_from_an_upstream_is_refunded_once(status: int, body: bytes) -> None:
    """A refusal not in OpenAI's envelope was settled where it was read and again as it left
    the gateway: each gave its tenant twice its reservation back (nine of them raised a
    bucket that held 500 tokens to 3,315, and a request over the limit went through)."""
    fake = FakeUpstream("refuse", refusal_status=status, refusal_body=body)
    with _keyed_gateway(fake) as (gw, _, settled):
        for _ in range(3):
            assert _post(gw).status_code == status
        _wait_for(lambda: len(settled) >= 3)
        time.sleep(0.2)  # a second settlement, if any, has come by now
    assert len(settled) == 3 and len({rid for rid, _ in settled}) == 3  # once each
    assert all(used == 0 for _, used in settled)


def test_a_reply_without_a_usage_is_charged_its_reservation_as_a_stream_is() -> None:
    fake = FakeUpstream("no_usage")
    with _keyed_gateway(fake) as (gw, _, settled):
        r = _post(gw)
        _wait_for(lambda: settled)
    assert r.status_code == 200
    ((_, used),) = settled
    assert used >= 400  # the whole reservation: at least max_tokens


def test_an_upstream_whose_requests_fail_is_ejected_though_its_checks_pass() -> None:
    """P0 tried the failing upstream first every time (it failed fast, so it looked idle),
    and its passing checks never let it be ejected: 30 of 30 P0 requests went there first."""
    bad, good = FakeUpstream("fail"), FakeUpstream("ok")
    with ExitStack() as stack:
        urls = [stack.enter_context(fake_upstream(f)) for f in (bad, good)]
        gw, state = stack.enter_context(gateway(urls, extra="ejection_hold_s = 30"))
        for i in range(10):
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json={**CHAT, "messages": [{"role": "user", "content": f"p{i}"}]},
                headers={"x-request-tier": "realtime"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
        time.sleep(0.5)  # checks of both pass meanwhile
        healthy = state.router.state("f0").healthy
        metrics = httpx.get(gw.url + "/metrics").text
    assert len(bad.bodies) == 3 and len(good.bodies) == 10
    assert not healthy
    assert metric_counts(metrics, "tierserve_gateway_upstream_ejections", "upstream") == {"f0": 1.0}


def test_a_stream_that_is_not_server_sent_events_goes_to_another_upstream() -> None:
    """Text or HTML under text/event-stream reached the client, then an error event."""
    bad, good = FakeUpstream("not_sse"), FakeUpstream("ok")
    with ExitStack() as stack:
        urls = [stack.enter_context(fake_upstream(f)) for f in (bad, good)]
        gw, _ = stack.enter_context(gateway(urls))
        texts = []
        for i in range(4):
            body = {**CHAT, "messages": [{"role": "user", "content": f"p{i}"}], "stream": True}
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
                texts.append(r.read().decode())
    assert bad.bodies  # tried
    for text in texts:
        assert "not sse" not in text and "<html>" not in text
        assert text.endswith("data: [DONE]\n\n") and '"upstream_failed"' not in text


def test_an_upstreams_model_list_is_read_again_while_it_stays_healthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Read only while an upstream was not healthy: one restarted with another model between
    two checks kept its old list, and the new model was a 404 for good."""
    monkeypatch.setattr(poller, "MODELS_REFRESH_S", 0.3)
    fake = FakeUpstream("ok")
    with fake_upstream(fake) as url, gateway([url]) as (gw, _):
        assert httpx.get(gw.url + "/v1/models").json()["data"][0]["id"] == FAKE_MODEL
        fake.model = "new-model"
        got: list[int] = []
        listed = threading.Event()

        def check() -> bool:
            ids = [m["id"] for m in httpx.get(gw.url + "/v1/models").json()["data"]]
            if "new-model" in ids:
                listed.set()
            return listed.is_set()

        _wait_for(check)
        r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "new-model"}, timeout=30)
        got.append(r.status_code)
    assert listed.is_set() and got == [200]
