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
def _keyed_gateway(
    fake: FakeUpstream, extra: str = ""
) -> Iterator[tuple[Running, GatewayState, list[tuple[int, int]]]]:
    """A gateway with tenant `a` in front of `fake` (`extra`: more `[gateway]` settings), and
    every settlement it makes, as (id of the reservation, tokens used)."""
    with fake_upstream(fake) as url:
        ups = f'[[upstreams]]\nname = "f0"\nkind = "vllm"\nurl = "{url}"\n'
        with gateway_of(parse_gateway_config(tomllib.loads(TENANT + extra + "\n" + ups))) as (running, gw):
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


def _p0(gw: Running, i: int) -> httpx.Response:
    """A realtime request with a prompt of its own (prefix affinity spreads them)."""
    body = {**CHAT, "messages": [{"role": "user", "content": f"p{i}"}]}
    return httpx.post(
        gw.url + "/v1/chat/completions", json=body, headers={"x-request-tier": "realtime"}, timeout=30
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


def test_a_generation_past_the_read_timeout_fails_alone_and_is_charged_its_reservation() -> None:
    """A non-streaming generation longer than `read_timeout_s` was taken for a silent
    upstream: the upstream was ejected, the other requests awaiting its replies were cut and
    sent elsewhere, the long one went on to eject the next upstream, and its 502 refunded its
    whole reservation. Now it alone fails, stopped upstream, and is charged."""
    fake = FakeUpstream("ok", hold=threading.Event(), slow_on="long story", slow_reply_after_s=60.0)
    assert fake.hold is not None
    with _keyed_gateway(fake, extra="read_timeout_s = 3") as (gw, _, settled):
        long_story = {"messages": [{"role": "user", "content": "long story"}]}
        replies: dict[str, httpx.Response] = {}
        long = threading.Thread(target=lambda: replies.setdefault("long", _post(gw, **long_story)))
        long.start()
        _wait_for(lambda: fake.bodies)
        time.sleep(1.0)  # the other one's own read timeout comes 1 s after the long one's
        other = threading.Thread(target=lambda: replies.setdefault("other", _post(gw)))
        other.start()
        _wait_for(lambda: len(fake.bodies) == 2)
        long.join(timeout=30)
        fake.hold.set()  # the other one, awaited on the same upstream meanwhile, is answered now
        other.join(timeout=30)
        _wait_for(lambda: len(settled) == 2 and fake.num_clients_gone == 1)
        metrics = httpx.get(gw.url + "/metrics").text
    timed_out = replies["long"]
    assert timed_out.status_code == 504 and timed_out.json()["error"]["code"] == "upstream_timeout"
    assert replies["other"].status_code == 200, replies["other"].text  # not cut
    assert len(fake.bodies) == 2 and fake.num_clients_gone == 1  # neither sent again; the long one stopped
    assert metric_counts(metrics, "tierserve_gateway_upstream_ejections", "upstream") == {}
    assert metric_counts(metrics, "tierserve_gateway_retries", "upstream") == {}
    assert sorted(used for _, used in settled)[0] == 5  # the other one: its usage
    assert sorted(used for _, used in settled)[1] >= 400  # the long one: at least its max_tokens


def test_an_upstream_whose_requests_fail_is_ejected_though_its_checks_pass() -> None:
    """P0 tried the failing upstream first every time (it failed fast, so it looked idle),
    and its passing checks never let it be ejected: 30 of 30 P0 requests went there first."""
    bad, good = FakeUpstream("fail"), FakeUpstream("ok")
    with ExitStack() as stack:
        urls = [stack.enter_context(fake_upstream(f)) for f in (bad, good)]
        gw, state = stack.enter_context(gateway(urls, extra="ejection_hold_s = 30"))
        for i in range(10):
            r = _p0(gw, i)
            assert r.status_code == 200, r.text
        time.sleep(0.5)  # checks of both pass meanwhile
        healthy = state.router.state("f0").healthy
        metrics = httpx.get(gw.url + "/metrics").text
    assert len(bad.bodies) == 3 and len(good.bodies) == 10
    assert not healthy
    assert metric_counts(metrics, "tierserve_gateway_upstream_ejections", "upstream") == {"f0": 1.0}


def test_a_request_that_fails_on_every_upstream_ejects_none() -> None:
    """A request every upstream fails (an input the engines cannot take) was held against
    each: one call of the OpenAI client (three tries, each on both upstreams) ejected both,
    and every request, P0's too, got 503 no_upstream for the hold."""
    fakes = [FakeUpstream("ok", fail_on="poison"), FakeUpstream("ok", fail_on="poison")]
    poison = {**CHAT, "messages": [{"role": "user", "content": "poison"}]}
    with ExitStack() as stack:
        urls = [stack.enter_context(fake_upstream(f)) for f in fakes]
        gw, state = stack.enter_context(gateway(urls))
        for _ in range(3):  # the client's own retries
            assert httpx.post(gw.url + "/v1/chat/completions", json=poison, timeout=30).status_code == 502
        healthy = [state.router.state(name).healthy for name in ("f0", "f1")]
        after = httpx.post(
            gw.url + "/v1/chat/completions", json=CHAT, headers={"x-request-tier": "realtime"}, timeout=30
        )
    assert all(len(f.bodies) >= 3 for f in fakes)  # each failed it three times
    assert healthy == [True, True] and after.status_code == 200


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


@pytest.mark.parametrize("retry_after", ["7", "Wed, 21 Oct 2026 07:28:00 GMT", "100000"])
def test_a_503_that_says_when_to_come_back_is_a_full_upstream_not_a_failing_one(retry_after: str) -> None:
    fake = FakeUpstream(
        "refuse", refusal_status=503, retry_after=retry_after, refusal_body=b'{"error": {"message": "full"}}'
    )
    with fake_upstream(fake) as url, gateway([url]) as (gw, state):
        for _ in range(4):
            # 503 upstream_overloaded, or 502 where its Retry-After is no count of seconds
            assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code in (
                502,
                503,
            )
        upstream = state.router.state("f0")
    assert upstream.healthy and upstream.num_request_failures == 0


@pytest.mark.parametrize(
    ("first", "sse"),
    [
        (b"data: {}\n\n", True),
        (b"data\n\n", True),  # a field without a value
        (b"\xef\xbb\xbfdata: {}\n\n", True),  # a byte order mark first
        (b"foo: bar\ndata: {}\n\n", True),  # a field a client ignores
        (b": keep-alive\n\n", True),
        (b"this is not sse at all\n\n", False),
        (b'<html><a href="http://x">\n\n', False),
    ],
)
def test_the_first_events_are_checked_for_the_shape_of_sse_not_for_known_fields(
    first: bytes, sse: bool
) -> None:
    from tierserve.gateway.forward import _is_sse

    assert _is_sse(first) is sse


def _dropping_upstream(port: list[int], stop: threading.Event) -> None:
    """An upstream whose checks pass and which drops the connection of its first generation
    request without a reply (a stale keep-alive, a worker restart), then answers."""
    import asyncio
    import json

    from tests.gateway.fakes import METRICS

    dropped = False

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal dropped
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = next(
                    (int(h.split(b":", 1)[1]) for h in lines if h.lower().startswith(b"content-length:")), 0
                )
                await reader.readexactly(length)
                if lines[0].startswith(b"POST") and not dropped:
                    dropped = True
                    writer.close()
                    return
                if lines[0].startswith(b"POST"):
                    reply = {"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 1}}
                    body, kind = json.dumps(reply).encode(), b"application/json"
                elif b"/v1/models" in lines[0]:
                    body, kind = json.dumps({"data": [{"id": FAKE_MODEL}]}).encode(), b"application/json"
                else:
                    body, kind = METRICS.encode(), b"text/plain"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (kind, len(body))
                )
                writer.write(body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()

    asyncio.run(main())


def test_one_dropped_connection_is_one_failure_not_an_ejection() -> None:
    """Any connection error ejected at once and held the upstream out 10 s: with one
    upstream, one stale keep-alive connection was 10 s of 503s."""
    port: list[int] = []
    stop = threading.Event()
    thread = threading.Thread(target=_dropping_upstream, args=(port, stop), daemon=True)
    thread.start()
    try:
        _wait_for(lambda: port)
        with gateway([f"http://127.0.0.1:{port[0]}"]) as (gw, state):
            _wait_for(lambda: state.router.state("f0").healthy)
            first = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            again = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            upstream = state.router.state("f0")
    finally:
        stop.set()
        thread.join(5)
    assert first.status_code == 502  # its only upstream failed it: nothing else to try
    assert again.status_code == 200 and upstream.healthy


@pytest.mark.parametrize("body", [b'{"error": {"message": "full"}}', b'{"detail": "full"}'], ids=str)
def test_a_failure_is_not_held_against_an_upstream_when_the_request_was_refused_elsewhere(
    body: bytes,
) -> None:
    """A refusal elsewhere is not the request served: the failure is not held against the
    upstream that failed it, whatever the refusal's shape (it was held where the refusal
    came in OpenAI's envelope, and not where it came in another shape)."""
    bad = FakeUpstream("fail")
    full = FakeUpstream("refuse", refusal_status=429, refusal_body=body)
    with ExitStack() as stack:
        urls = [stack.enter_context(fake_upstream(f)) for f in (bad, full)]
        gw, state = stack.enter_context(gateway(urls))
        for i in range(5):
            r = _p0(gw, i)
            assert r.status_code == 429
        upstream = state.router.state("f0")
    assert upstream.healthy and upstream.num_request_failures == 0
