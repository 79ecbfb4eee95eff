"""The gateway's request counts add up: each request that reaches the dispatcher is counted
once, sent (a routing decision, then an upstream outcome) or not (a rejection)."""

from __future__ import annotations

import socket
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.fakes import (
    FAKE_MODEL,
    FakeUpstream,
    fake_upstream,
    gateway_of,
    gateway_over,
    metric_counts,
    spread_body,
)
from tierserve.gateway.config import GatewayConfig, parse_gateway_config
from tierserve.gateway.state import GatewayState

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 20
    while not done():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def _one_vllm(url: str, upstream: str = "", gateway: str = "", head: str = "") -> GatewayConfig:
    """A gateway over one upstream of kind vllm, scraped every 0.2 s; `upstream` and
    `gateway` add lines to their tables, `head` tables before them."""
    return parse_gateway_config(
        tomllib.loads(
            f"{head}[gateway]\nscrape_interval_s = 0.2\n{gateway}"
            f'[[upstreams]]\nname = "f0"\nkind = "vllm"\nurl = "{url}"\n{upstream}'
        )
    )


@contextmanager
def _one_seated_one_queued(
    send: Callable[[str], None],
) -> Iterator[tuple[Any, GatewayState, Callable[[], None]]]:
    """A gateway over one upstream with one seat; `send(endpoint)` runs in two threads, the
    first request taking the seat and the second waiting in the gateway's queue, until
    `release()` (at the latest, the end of the block) lets the upstream answer both."""
    hold = threading.Event()
    with ExitStack() as stack:
        url = stack.enter_context(fake_upstream(FakeUpstream("ok", hold=hold)))
        gw, state = stack.enter_context(gateway_of(_one_vllm(url, upstream="max_in_flight = 1\n")))
        endpoint = gw.url + "/v1/chat/completions"
        senders = [threading.Thread(target=send, args=(endpoint,)) for _ in range(2)]
        senders[0].start()  # takes the one seat
        _until(lambda: state.router.state("f0").num_in_flight == 1)
        senders[1].start()  # waits in the queue for it

        def release() -> None:
            hold.set()
            for sender in senders:
                sender.join(60)

        _until(lambda: len(state.flow) == 1)
        try:
            yield gw, state, release
        finally:
            release()


def test_a_mix_of_served_queued_gone_and_refused_requests_adds_up() -> None:
    """A request that waited in the gateway's queue was counted twice in the routing
    decisions (`queued`, then the reason it was sent by), and one whose client left the
    queue was counted nowhere: the decisions did not match the upstream outcomes, and the
    requests could not be added up from the metrics."""
    hold = threading.Event()
    upstream = FakeUpstream("ok", hold=hold)  # each reply waits for `hold`
    with fake_upstream(upstream) as url:
        config = _one_vllm(
            url, upstream="max_in_flight = 1\n", head="[limits.queue_cap]\nP0 = 2\nP1 = 2\nP2 = 2\nP3 = 2\n"
        )
        with gateway_of(config) as (gw, state):
            endpoint = gw.url + "/v1/chat/completions"
            served: list[int] = []

            def send() -> None:
                served.append(httpx.post(endpoint, json=CHAT, timeout=60).status_code)

            first = threading.Thread(target=send)  # takes the one seat: served at once
            first.start()
            _until(lambda: state.router.state("f0").num_in_flight == 1)
            second = threading.Thread(target=send)  # waits in the queue, then served
            second.start()
            _until(lambda: len(state.flow) == 1)
            # Waits in the queue behind it; its client goes before it is sent.
            host, port = gw.url.removeprefix("http://").split(":")
            gone = socket.create_connection((host, int(port)), timeout=10)
            body = httpx.Request("POST", endpoint, json=CHAT).read()
            head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            gone.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
            _until(lambda: len(state.flow) == 2)
            refused = httpx.post(endpoint, json=CHAT, timeout=60)  # the queue is full
            gone.close()
            _until(lambda: len(state.flow) == 1)
            hold.set()
            first.join(60)
            second.join(60)
            _until(lambda: state.num_in_flight == 0)
            metrics = httpx.get(gw.url + "/metrics").text
    assert served == [200, 200] and refused.status_code == 503
    assert refused.json()["error"]["code"] == "queue_full"
    decisions = metric_counts(metrics, "tierserve_gateway_routing_decisions", "reason")
    outcomes = metric_counts(metrics, "tierserve_gateway_upstream_requests", "outcome")
    rejections = metric_counts(metrics, "tierserve_rejections", "reason")
    assert outcomes == {"ok": 2.0}
    assert sum(decisions.values()) == 2.0 and "queued" not in decisions, decisions
    assert rejections == {"queue_full": 1.0, "client_left": 1.0}
    assert sum(outcomes.values()) + sum(rejections.values()) == 4  # every request, once


def _added_sum(metrics: str) -> tuple[float, float]:
    """`tierserve_gateway_added_seconds`' (sum, count)."""
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name.startswith("tierserve_gateway_added_seconds")
    }
    return values["tierserve_gateway_added_seconds_sum"], values["tierserve_gateway_added_seconds_count"]


def test_a_wait_in_the_gateway_queue_is_not_counted_as_the_gateway_s_added_time() -> None:
    """The added time is the gateway's own work on the way to the first token; a stream that
    waited 1.5 s in its queue for a seat (flow control, shown in `queue_wait_seconds`) was
    counted as 1.5 s of overhead, and under a queue every panel of it read 1 s, its top bucket."""
    statuses: list[int] = []

    def send(endpoint: str) -> None:
        with httpx.stream("POST", endpoint, json={**CHAT, "stream": True}, timeout=60) as reply:
            reply.read()
            statuses.append(reply.status_code)

    with _one_seated_one_queued(send) as (gw, state, release):
        time.sleep(1.5)
        release()
        _until(lambda: state.num_in_flight == 0)
        total_s, count = _added_sum(httpx.get(gw.url + "/metrics").text)
    assert statuses == [200, 200] and count == 2
    assert total_s < 0.5, f"{total_s:.3f} s added over two streams: the queue's wait was counted"


def test_an_attempt_on_an_upstream_that_failed_is_not_counted_as_the_gateway_s_added_time() -> None:
    """A stream retried after an upstream took 0.5 s to fail: that half second is the
    upstream's, not the gateway's own work."""
    bad, good = FakeUpstream("fail", reply_after_s=0.5), FakeUpstream("ok")
    with gateway_over(bad, good) as gw:
        for i in range(8):
            body = spread_body(CHAT, i, stream=True)
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as reply:
                reply.read()
                assert reply.status_code == 200
        total_s, count = _added_sum(httpx.get(gw.url + "/metrics").text)
    assert len(bad.bodies) > 0 and count == 8, "no stream was retried"
    assert total_s < 0.25, f"{total_s:.3f} s added over 8 streams, {len(bad.bodies)} retried after 0.5 s"


def test_a_malformed_vllm_xargs_is_a_400_and_a_failure_no_branch_foresaw_gives_its_seat_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`"vllm_xargs": "oops"` was a 500 whose upstream seat was never given back: two such
    requests filled `max_in_flight = 2` for good, and every request after them timed out in
    the gateway's queue. Now the field is refused at the door, and any failure between the
    route and the reply gives the seat back."""
    from tierserve.gateway import forward

    with fake_upstream(FakeUpstream("ok")) as url:
        config = _one_vllm(url, upstream="max_in_flight = 1\n")
        with gateway_of(config) as (gw, state):
            endpoint = gw.url + "/v1/chat/completions"
            for bad in ("oops", 5, [1, 2]):
                reply = httpx.post(endpoint, json={**CHAT, "vllm_xargs": bad}, timeout=60)
                assert reply.status_code == 400 and reply.json()["error"]["param"] == "vllm_xargs"
            assert httpx.post(endpoint, json={**CHAT, "vllm_xargs": {"a": 1}}, timeout=60).status_code == 200

            def broken(*args: object, **kwargs: object) -> None:
                raise TypeError("a bug")

            monkeypatch.setattr(forward, "pass_down", broken)
            for _ in range(2):
                assert httpx.post(endpoint, json=CHAT, timeout=60).status_code == 500
            assert state.router.state("f0").num_in_flight == 0
            monkeypatch.undo()
            assert httpx.post(endpoint, json=CHAT, timeout=60).status_code == 200
            metrics = httpx.get(gw.url + "/metrics").text
    outcomes = metric_counts(metrics, "tierserve_gateway_upstream_requests", "outcome")
    assert outcomes == {"ok": 2.0, "error": 2.0}


def test_a_client_that_closes_on_done_read_the_whole_stream() -> None:
    """OpenAI's Python client closes its connection as soon as it reads `data: [DONE]`; if
    the upstream's stream had not ended yet, the gateway counted the stream as client_left
    (3-15 % of streams) and dropped the upstream connection."""
    with fake_upstream(FakeUpstream("ok", end_after_done_s=1.0)) as url:
        config = _one_vllm(url)
        with gateway_of(config) as (gw, state):
            with httpx.stream(
                "POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as reply:
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        break  # and the connection closes, the upstream's stream still open
            _until(lambda: state.num_in_flight == 0)
            metrics = httpx.get(gw.url + "/metrics").text
    assert metric_counts(metrics, "tierserve_gateway_upstream_requests", "outcome") == {"ok": 1.0}


def test_a_failure_after_the_reply_was_read_gives_the_seat_back_once() -> None:
    """A reply whose Retry-After the gateway cannot pass on (not latin-1) failed after `_whole`
    had given its seat back, and the catch-all gave it back again: the other request's seat
    went with it (in flight 0 while it ran) and the request was counted twice."""
    import asyncio

    from tests.gateway.fakes import serve_thread

    posts = 0

    def upstream(app: Any) -> Any:
        async def asgi(scope: Any, receive: Any, send: Any) -> None:
            nonlocal posts
            if scope["type"] != "http" or scope["method"] != "POST":
                return await app(scope, receive, send)
            posts += 1
            slow = posts == 1
            if slow:
                await asyncio.sleep(2)  # holds its seat meanwhile

            async def bad_header(message: Any) -> None:
                if message["type"] == "http.response.start" and not slow:
                    message = {**message, "headers": [*message["headers"], (b"retry-after", "5€".encode())]}
                await send(message)

            await app(scope, receive, bad_header)

        return asgi

    with serve_thread(None, upstream(FakeUpstream("ok").app())) as up:
        config = _one_vllm(up.url, upstream="max_in_flight = 2\n")
        with gateway_of(config) as (gw, state):
            endpoint = gw.url + "/v1/chat/completions"
            slow = threading.Thread(target=lambda: httpx.post(endpoint, json=CHAT, timeout=60))
            slow.start()
            _until(lambda: state.router.state("f0").num_in_flight == 1)
            assert httpx.post(endpoint, json=CHAT, timeout=60).status_code == 500
            assert state.router.state("f0").num_in_flight == 1  # the slow one's seat is still taken
            slow.join(60)
            _until(lambda: state.num_in_flight == 0)
            metrics = httpx.get(gw.url + "/metrics").text
    outcomes = metric_counts(metrics, "tierserve_gateway_upstream_requests", "outcome")
    assert outcomes == {"ok": 1.0, "error": 1.0}


@pytest.mark.parametrize("one_write", [False, True])
def test_an_upstream_that_lingers_after_done_does_not_hold_the_request(one_write: bool) -> None:
    """After `data: [DONE]` the stream is whole; an upstream whose end came 30 s later held the
    request in flight until the read timeout and it was counted broken (also when the whole
    stream came with its first bytes, before the relay's loop)."""
    with fake_upstream(FakeUpstream("ok", end_after_done_s=30.0, one_write=one_write)) as url:
        config = _one_vllm(url, gateway="read_timeout_s = 20.0\n")
        with gateway_of(config) as (gw, state):
            started = time.monotonic()
            reply = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60)
            assert reply.text.endswith("data: [DONE]\n\n") and time.monotonic() - started < 10
            _until(lambda: state.num_in_flight == 0)
            metrics = httpx.get(gw.url + "/metrics").text
    assert metric_counts(metrics, "tierserve_gateway_upstream_requests", "outcome") == {"ok": 1.0}


def test_a_request_waiting_in_the_queue_holds_its_body_once_not_also_its_validated_copy() -> None:
    """A body of 1 MiB of token ids takes about 5 MiB as the dict forwarded and 5 MiB more as
    the validated model, which was kept through the request's wait and attempts."""
    import gc

    from tierserve.server.protocol import ChatCompletionRequest

    def validated_alive() -> int:
        gc.collect()
        return sum(type(o) is ChatCompletionRequest for o in gc.get_objects())

    replies: list[int] = []

    def send(endpoint: str) -> None:
        replies.append(httpx.post(endpoint, json=CHAT, timeout=60).status_code)

    before = validated_alive()
    with _one_seated_one_queued(send) as (_, _, release):
        during = validated_alive()
        release()
    assert replies == [200, 200]
    assert during == before, f"{during - before} validated requests kept while they waited or ran"


def test_a_tier_closed_by_a_queue_cap_of_0_is_a_400_at_the_gateway_too() -> None:
    with (
        fake_upstream(FakeUpstream("ok")) as url,
        gateway_of(_one_vllm(url, head="[limits.queue_cap]\nP3 = 0\n")) as (gw, state),
    ):
        closed = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "priority": 3}, timeout=30)
        served = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "priority": 2}, timeout=30)
    assert closed.status_code == 400 and closed.json()["error"]["code"] == "tier_closed"
    assert "retry-after" not in closed.headers and served.status_code == 200
    assert state.num_in_flight == 0
