"""Faults between the gateway and its upstreams, and SIGTERM, against fake upstreams."""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
import tomllib
from collections.abc import Sequence

import httpx
import pytest

from tests.gateway.fakes import (
    FAKE_MODEL,
    FakeUpstream,
    fake_upstream,
    gateway,
    gateway_of,
    gateway_over,
    metric_counts,
    spread_body,
)
from tierserve.gateway import forward
from tierserve.gateway.config import parse_gateway_config
from tierserve.server.drain import SAME_SIGNAL_S

CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_an_upstream_failing_before_the_first_byte_is_retried_on_another() -> None:
    bad, good = FakeUpstream("fail"), FakeUpstream("ok")
    with gateway_over(bad, good) as gw:
        for i in range(8):
            r = httpx.post(
                gw.url + "/v1/chat/completions", json=spread_body(CHAT, i, stream=i % 2 == 0), timeout=30
            )
            assert r.status_code == 200, r.text
        metrics = httpx.get(gw.url + "/metrics").text
    assert len(good.bodies) == 8 and len(bad.bodies) > 0
    assert f'tierserve_gateway_retries_total{{upstream="f0"}} {float(len(bad.bodies))}' in metrics


def test_a_stream_broken_midway_ends_with_an_error_event_the_client_sees() -> None:
    with (
        fake_upstream(FakeUpstream("break")) as url,
        gateway([url]) as (gw, _),
        httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r,
    ):
        assert r.status_code == 200
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert '"t0"' in events[0] and '"t1"' in events[1]
    assert '"code": "upstream_failed"' in events[-2] and events[-1] == "data: [DONE]"


def test_the_tier_reaches_a_vllm_upstream_and_the_usage_event_it_was_asked_for_is_dropped() -> None:
    fake = FakeUpstream("ok")
    with fake_upstream(fake) as url, gateway([url]) as (gw, _):
        headers = {"x-request-tier": "batch"}
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
        ) as r:
            text = r.read().decode()
    sent = fake.bodies[0]
    assert sent["priority"] == 2 and sent["vllm_xargs"] == {"tier": "P2", "tenant": "default"}
    assert sent["stream_options"] == {"include_usage": True}
    assert text.endswith("data: [DONE]\n\n") and '"usage"' not in text


def test_continuous_usage_without_include_usage_is_not_asked_of_the_upstream() -> None:
    """The gateway asks for the usage for its own count; vLLM's continuous_usage_stats,
    which the client's request left without effect, must not ride along with it (it would
    put a usage in every chunk the client sees)."""
    fake = FakeUpstream("ok")
    body = {**CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    with (
        fake_upstream(fake) as url,
        gateway([url]) as (gw, _),
        httpx.stream("POST", gw.url + "/v1/chat/completions", json=body) as r,
    ):
        r.read()
    assert fake.bodies[0]["stream_options"] == {"include_usage": True}


def test_sigterm_lets_the_streams_in_flight_finish_and_refuses_new_requests() -> None:
    # 3 s of stream: the drain and the refused request come well inside it on a busy host
    # (at 1 s, under a benchmark on the same 2 cores, the stream ended first and the
    # gateway had closed its socket: "connection refused").
    slow = FakeUpstream("ok", num_events=10, event_gap_s=0.3)
    with fake_upstream(slow) as url, gateway([url]) as (gw, state):
        result: dict[str, str] = {}

        def stream() -> None:
            with httpx.stream(
                "POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30
            ) as r:
                result["text"] = r.read().decode()

        t = threading.Thread(target=stream)
        t.start()
        while state.num_in_flight == 0:
            threading.Event().wait(0.01)
        gw.server.handle_exit(signal.SIGTERM, None)
        while not state.draining:
            threading.Event().wait(0.01)
        refused = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        ready = httpx.get(gw.url + "/ready")
        t.join(30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    assert ready.status_code == 503
    assert result["text"].count('"delta"') == 10 and result["text"].endswith("data: [DONE]\n\n")


def test_a_client_gone_mid_body_is_no_server_error_and_the_gateway_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeUpstream("ok")
    with fake_upstream(fake) as url, gateway([url]) as (gw, _):
        host, port = gw.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b'content-length: 1000\r\n\r\n{"model": '
            )
        time.sleep(0.5)  # the gateway notices the close while it reads the body
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200, r.text
    assert not fake.bodies[:-1]  # nothing of the cut request reached the upstream
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


@pytest.mark.parametrize("tier", ["P0", "P1", "P2", "P3"])
@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b'{"model": "fake", "prompt": "\\ud800", "max_tokens": 2}'),
        (
            "/v1/chat/completions",
            b'{"model": "fake", "messages": [{"role": "user", "content": "hi \\ud83d"}]}',
        ),
    ],
)
def test_a_lone_surrogate_escape_is_invalid_json_at_every_tier(tier: str, path: str, body: bytes) -> None:
    fake = FakeUpstream("ok")
    with fake_upstream(fake) as url, gateway([url]) as (gw, _):
        headers = {"content-type": "application/json", "x-request-tier": tier}
        r = httpx.post(gw.url + path, content=body, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    # The parser says "unexpected end of hex escape", which reads as a typo; the surrogate is named.
    assert "a lone one is not text" in r.json()["error"]["message"]
    assert not fake.bodies  # refused by the gateway, as `tierserve serve` refuses it


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_client_leaves_before_the_first_byte_is_dropped_upstream_too(stream: bool) -> None:
    """A stream's client was watched only from the upstream's first bytes on: one that left
    while the upstream was silent (a long prefill, a queue there) or while the request
    waited in the gateway's queue kept its upstream call and its seat until then."""
    slow = FakeUpstream("ok", reply_after_s=20.0)
    with fake_upstream(slow) as url, gateway([url]) as (gw, state):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=0.5)
        deadline = time.monotonic() + 5
        while (state.num_in_flight or not slow.num_clients_gone) and time.monotonic() < deadline:
            time.sleep(0.05)
        metrics = httpx.get(gw.url + "/metrics").text
    assert slow.num_clients_gone == 1 and state.num_in_flight == 0
    assert state.router.state("f0").num_in_flight == 0
    assert 'tierserve_gateway_upstream_requests_total{outcome="client_left",upstream="f0"} 1.0' in metrics


def test_a_stream_cut_at_the_drain_timeout_ends_with_an_error_event_and_done() -> None:
    slow = FakeUpstream("ok", num_events=100, event_gap_s=0.1)
    with fake_upstream(slow) as url, gateway([url], drain_timeout_s=0.5) as (gw, state):
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30
        ) as r:
            lines = r.iter_lines()
            next(lines)
            started = time.monotonic()
            gw.server.handle_exit(signal.SIGTERM, None)
            rest = [line for line in lines if line]
        assert time.monotonic() - started < 5  # not the upstream's 10 s
        assert any('"code": "aborted"' in line for line in rest) and rest[-1] == "data: [DONE]"
        assert state.num_in_flight == 0 and not state.relays


def test_one_model_can_be_retrieved_through_the_gateway_as_from_the_server() -> None:
    """The OpenAI client's `models.retrieve` failed through the gateway (404 for any id)."""
    with fake_upstream(FakeUpstream("ok")) as url, gateway([url]) as (gw, _):
        card = httpx.get(f"{gw.url}/v1/models/{FAKE_MODEL}", timeout=10)
        missing = httpx.get(f"{gw.url}/v1/models/no-such-model", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == FAKE_MODEL
    assert isinstance(card.json()["created"], int)  # OpenAI's Model object requires it (the server's has it)
    # No upstream names: often their addresses, which a 502 keeps from the client too.
    assert set(card.json()) == {"id", "object", "created", "owned_by"}
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_model_card_gives_the_least_context_of_the_upstreams_serving_it() -> None:
    """Clients size prompts by the card's `max_model_len` (vLLM's and the server's cards have
    it); the gateway's dropped it. The least of the upstreams' is what fits all of them;
    where one does not say, nor does the gateway."""
    ups = [FakeUpstream("ok", max_model_len=4096), FakeUpstream("ok", max_model_len=2048)]
    with fake_upstream(ups[0]) as a, fake_upstream(ups[1]) as b, gateway([a, b]) as (gw, _):
        listed = httpx.get(f"{gw.url}/v1/models", timeout=10).json()["data"]
        card = httpx.get(f"{gw.url}/v1/models/{FAKE_MODEL}", timeout=10).json()
    assert [c["max_model_len"] for c in listed] == [card["max_model_len"]] == [2048]
    with fake_upstream(ups[0]) as a, fake_upstream(FakeUpstream("ok")) as b, gateway([a, b]) as (gw, _):
        card = httpx.get(f"{gw.url}/v1/models/{FAKE_MODEL}", timeout=10).json()
    assert card["id"] == FAKE_MODEL and "max_model_len" not in card


def test_a_502_does_not_name_the_addresses_behind_the_gateway() -> None:
    """An upstream gone before the first byte gave the client aiohttp's error text,
    "Cannot connect to host 127.0.0.1:PORT"."""
    from contextlib import ExitStack

    with ExitStack() as upstream:
        url = upstream.enter_context(fake_upstream(FakeUpstream("ok")))
        with gateway([url]) as (gw, _):
            upstream.close()  # admitted, then gone
            r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    port = url.rsplit(":", 1)[1]
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
    assert port not in r.text and "1 tried" in r.json()["error"]["message"]


def test_a_model_whose_upstreams_are_all_ejected_is_a_503_no_upstream_not_a_404() -> None:
    """With another upstream serving another model still up, a model whose only upstream was
    down for a moment was answered 404 `model_not_found` ("does not exist"), which clients
    do not retry, instead of the 503 `no_upstream` it gets when no upstream is up at all."""
    from contextlib import ExitStack

    other = FakeUpstream("ok", model="other")
    with fake_upstream(other) as other_url, ExitStack() as upstream:
        url = upstream.enter_context(fake_upstream(FakeUpstream("ok")))
        with gateway([url, other_url]) as (gw, state):
            upstream.close()  # admitted, then gone
            for _ in range(300):  # ejected by the health checks (every 0.2 s), bounded
                if not state.router.states[0].healthy:
                    break
                time.sleep(0.05)
            assert not state.router.states[0].healthy
            down = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
            unknown = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "nope"}, timeout=30)
    assert down.status_code == 503 and down.json()["error"]["code"] == "no_upstream", down.text
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_a_non_streaming_request_cut_at_the_drain_timeout_gets_a_503() -> None:
    """It was cancelled with the server after uvicorn's own grace, with no answer at all."""
    slow = FakeUpstream("ok", reply_after_s=10.0)
    with fake_upstream(slow) as url, gateway([url], drain_timeout_s=0.5) as (gw, state):
        answers: list[httpx.Response] = []
        client = threading.Thread(
            target=lambda: answers.append(httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30))
        )
        client.start()
        deadline = time.monotonic() + 10
        while not state.calls and time.monotonic() < deadline:
            time.sleep(0.02)
        started = time.monotonic()
        gw.server.handle_exit(signal.SIGTERM, None)
        client.join(timeout=10)
        assert time.monotonic() - started < 5  # not the upstream's 10 s
    (r,) = answers
    assert r.status_code == 503 and r.json()["error"]["code"] == "aborted"
    assert state.num_in_flight == 0 and not state.calls


def test_an_upstream_ejected_by_a_forwarded_request_is_said_once_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request that could not connect ejected its upstream and counted it, but the log said
    only "failed before the first byte": no line said the upstream was ejected, or why. The
    health checks here cannot eject it (1000 failures), so the request is what does."""
    from contextlib import ExitStack

    caplog.set_level(logging.WARNING, logger="tierserve.gateway")
    with ExitStack() as upstream:
        url = upstream.enter_context(fake_upstream(FakeUpstream("ok")))
        with gateway([url], extra="eject_after_failures = 1000\nstale_after_s = 1000") as (gw, state):
            upstream.close()  # admitted, then gone
            codes = [httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code]
            assert not state.router.state("f0").healthy
            for _ in range(3):  # more requests and health checks while it stays ejected
                time.sleep(0.2)
                codes.append(httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30).status_code)
            metrics = httpx.get(gw.url + "/metrics").text
    assert codes == [502, 503, 503, 503]
    said = [r for r in caplog.records if "f0" in r.getMessage() and "failed before" not in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    (line,) = said
    assert line.levelno == logging.WARNING and "upstream f0 ejected" in line.getMessage()
    assert "a forwarded request failed" in line.getMessage() and "Cannot connect" in line.getMessage()
    assert 'tierserve_gateway_upstream_ejections_total{upstream="f0"} 1.0' in metrics


def test_a_request_still_uploading_when_the_drain_begins_gets_503_draining_unread() -> None:
    """With nothing in flight the drain ended at once, and uvicorn then cancelled the
    handler still waiting for its body: a plain-text 500 and a traceback."""
    from urllib.parse import urlsplit

    from tests.server.test_http_limits import read_all, status_and_code

    with fake_upstream(FakeUpstream("ok")) as url, gateway([url], drain_timeout_s=5) as (gw, state):
        parts = urlsplit(gw.url)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n"
        with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10) as sock:
            sock.sendall(head + b'{"model": "')  # and no more of it
            deadline = time.monotonic() + 10
            while not len(state.uploads) and time.monotonic() < deadline:
                time.sleep(0.02)
            gw.server.handle_exit(signal.SIGTERM, None)
            response = read_all(sock)
    assert status_and_code(response) == (503, "draining")
    assert b"connection: close" in response.lower()


def test_a_drain_that_begins_while_a_request_waits_for_its_limits_refuses_it() -> None:
    """The drain waits for the requests in flight; one still at the rate limiter when it
    began was sent upstream after the drain had found nothing to wait for."""
    fake = FakeUpstream("ok")
    with fake_upstream(fake) as url, gateway([url]) as (gw, state):
        acquire = state.limiter.acquire

        async def acquire_while_the_drain_begins(*args: object, **kwargs: object) -> object:
            state.draining = True
            return await acquire(*args, **kwargs)  # type: ignore[arg-type]

        state.limiter.acquire = acquire_while_the_drain_begins  # type: ignore[method-assign]
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
    assert not fake.bodies


def test_a_stream_that_breaks_inside_its_first_event_is_retried_and_the_client_gets_whole_events() -> None:
    """Half an event was passed on, then the error event: the OpenAI client failed on the
    half (JSONDecodeError) before it read the error, and the request, of which the client had
    nothing whole, was not tried elsewhere."""
    halfway, good = FakeUpstream("halfway"), FakeUpstream("ok")
    with gateway_over(halfway, good) as gw:
        for i in range(6):
            body = spread_body(CHAT, i, stream=True)
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
                text = r.read().decode()
            events = [e for e in text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]" and "error" not in text, text
            assert all(json.loads(e.removeprefix("data: ")) for e in events[:-1])  # every one whole
    assert len(good.bodies) == 6 and len(halfway.bodies) > 0


def test_every_upstream_full_with_a_retry_after_gives_a_503_with_the_longest() -> None:
    """Their 503s with Retry-After 30 reached the client as a 502 asking for a retry in 1 s."""
    busy = [FakeUpstream("refuse", refusal_status=503, retry_after=after) for after in ("30", "12")]
    with (
        fake_upstream(busy[0]) as url0,
        fake_upstream(busy[1]) as url1,
        gateway([url0, url1]) as (gw, _),
    ):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        metrics = httpx.get(gw.url + "/metrics").text
    assert r.status_code == 503 and r.headers["retry-after"] == "30"
    assert r.json()["error"]["code"] == "upstream_overloaded"
    assert all(len(f.bodies) == 1 for f in busy)
    # One retry (off the first upstream), one final failure, and the refusal counted once.
    # Every failed attempt counted as a retry, and the refusal nowhere.
    assert sum(metric_counts(metrics, "tierserve_gateway_retries", "upstream").values()) == 1.0
    outcomes = metric_counts(metrics, "tierserve_gateway_upstream_requests", "outcome")
    assert outcomes == {"retried": 1.0, "failed": 1.0}
    assert metric_counts(metrics, "tierserve_rejections", "reason") == {"upstream_overloaded": 1.0}


def test_a_whole_reply_past_the_limit_is_a_502_not_the_gateways_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(forward, "MAX_REPLY_BYTES", 40)  # the fake's answer is about 120 bytes
    fake = FakeUpstream("ok")
    with fake_upstream(fake) as url, gateway([url]) as (gw, _):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        metrics = httpx.get(gw.url + "/metrics").text
    assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_reply_too_large"
    assert r.headers["x-tierserve-tier"] == "P1"  # as every other answer (it alone had none)
    assert 'tierserve_gateway_upstream_requests_total{outcome="too_large",upstream="f0"} 1.0' in metrics


def test_a_stream_broken_midway_does_not_tell_the_client_the_upstreams_address() -> None:
    with (
        fake_upstream(FakeUpstream("break")) as url,
        gateway([url]) as (gw, _),
        httpx.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30) as r,
    ):
        text = r.read().decode()
    assert '"code": "upstream_failed"' in text and "f0" not in text and "127.0.0.1" not in text


def _send_while_checks_fail(
    stuck: FakeUpstream,
    good: FakeUpstream | None,
    checks: Sequence[str],
    stream: bool,
    kind: str = "vllm",
) -> tuple[list[httpx.Response], float, str]:
    """Six requests, some held by `stuck`; once one is there, its checks turn each of `checks`
    in turn, 2 s apart. The replies, the seconds from the last turn until the last reply,
    and the gateway's metrics."""
    fakes = (stuck,) if good is None else (stuck, good)
    with gateway_over(*fakes, kind=kind) as gw:
        results: list[httpx.Response] = []

        def send(i: int) -> None:
            body = spread_body(CHAT, i, stream=stream)
            results.append(httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=90))

        threads = [threading.Thread(target=send, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while not stuck.bodies and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stuck.bodies, "no request reached the stuck upstream"
        for earlier in checks[:-1]:
            stuck.checks = earlier
            time.sleep(2.0)  # ejected by now (checks every 0.2 s)
        started = time.monotonic()
        stuck.checks = checks[-1]
        if stuck.hold is not None and checks[-1] != "silent":
            time.sleep(3.0)  # ejected by now; then its replies come
            stuck.hold.set()
        for t in threads:
            t.join(timeout=90)
        return results, time.monotonic() - started, httpx.get(gw.url + "/metrics").text


@pytest.mark.parametrize("stream", [False, True])
def test_requests_awaiting_an_upstream_that_stopped_answering_go_to_another(stream: bool) -> None:
    """An upstream that stops (SIGSTOP, a hung process) fails its checks by silence and is
    ejected, but the requests already sent to it waited for the read timeout (600 s by
    default), P0's too. Nothing had reached their clients: they go to another upstream."""
    stuck, good = FakeUpstream("ok", hold=threading.Event()), FakeUpstream("ok")
    results, waited, metrics = _send_while_checks_fail(stuck, good, ["silent"], stream)
    assert [r.status_code for r in results] == [200] * 6
    assert waited < 20  # not the stuck upstream's 60 s hold
    assert len(good.bodies) == 6  # every request was answered by the good one in the end
    assert metric_counts(metrics, "tierserve_gateway_retries", "upstream")["f0"] > 0


def test_an_upstream_ejected_while_answering_that_then_goes_silent_has_its_requests_cut() -> None:
    """Ejected while its /metrics failed (its requests left to finish), then silent: no second
    ejection came to cut them, and they waited for the read timeout."""
    stuck, good = FakeUpstream("ok", hold=threading.Event()), FakeUpstream("ok")
    results, waited, _ = _send_while_checks_fail(stuck, good, ["error", "silent"], stream=False)
    assert [r.status_code for r in results] == [200] * 6
    assert waited < 20  # not the stuck upstream's 60 s hold
    assert len(good.bodies) == 6


@pytest.mark.parametrize(("checks", "kind"), [("error", "vllm"), ("draining", "tierserve")])
def test_an_upstream_ejected_while_it_still_answers_finishes_what_it_has(checks: str, kind: str) -> None:
    """A draining tierserve (its /ready says 503) or one whose metrics fail is ejected, yet
    still finishing its requests: cutting them gave a lone draining upstream's clients 502s."""
    stuck = FakeUpstream("ok", hold=threading.Event())
    results, _, metrics = _send_while_checks_fail(stuck, None, [checks], stream=False, kind=kind)
    # Each request sent to it is answered; those the gateway held after the ejection were
    # refused (no upstream left), none cut and sent nowhere.
    codes = sorted(r.status_code for r in results)
    assert codes == [200] * len(stuck.bodies) + [503] * (6 - len(stuck.bodies))
    assert 'tierserve_gateway_upstream_ejections_total{upstream="f0"} 1.0' in metrics
    assert 'tierserve_gateway_retries_total{upstream="f0"} 0.0' in metrics


def test_a_second_signal_cuts_the_drain_short_and_queued_requests_count_as_cut() -> None:
    """A second SIGTERM forced the exit at once: the clients got a plain-text 500 (and the
    log a traceback each) instead of the drain timeout's 503 `aborted`; and a request cut at
    the drain timeout, in the gateway's queue or at an upstream, was counted `client_left`."""
    slow = FakeUpstream("ok", reply_after_s=20.0)
    with fake_upstream(slow) as url:
        config = parse_gateway_config(
            tomllib.loads(
                f'[gateway]\nscrape_interval_s = 0.2\n[[upstreams]]\nname = "f0"\nkind = "vllm"\n'
                f'url = "{url}"\nmax_in_flight = 1\n'
            )
        )
        with gateway_of(config, drain_timeout_s=60) as (gw, state):
            answers: list[httpx.Response] = []

            def send(stream: bool) -> None:
                body = {**CHAT, "stream": stream}
                answers.append(httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=30))

            clients = [threading.Thread(target=send, args=(s,)) for s in (False, False, True)]
            for c in clients:  # one at the upstream, two in the gateway's queue
                c.start()
            deadline = time.monotonic() + 10
            while len(state.calls) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            gw.server.handle_exit(signal.SIGTERM, None)
            time.sleep(SAME_SIGNAL_S + 0.1)  # a signal again sooner is taken for the same one
            assert not answers  # the drain waits (60 s)
            started = time.monotonic()
            gw.server.handle_exit(signal.SIGTERM, None)
            for c in clients:
                c.join(timeout=10)
            assert time.monotonic() - started < 5
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(503, "aborted")] * 3
    assert not gw.server.force_exit and state.num_in_flight == 0
    counted = state.metrics.registry.get_sample_value
    upstream = "tierserve_gateway_upstream_requests_total"
    assert counted(upstream, {"upstream": "f0", "outcome": "cut"}) == 1
    assert not counted(upstream, {"upstream": "f0", "outcome": "client_left"})
    assert counted("tierserve_rejections_total", {"reason": "cut", "priority": "P1"}) == 2
    assert not counted("tierserve_rejections_total", {"reason": "client_left", "priority": "P1"})


def test_a_signal_once_the_drain_is_over_forces_the_exit() -> None:
    """After the drain, uvicorn may wait on connections; a second signal set only the drain's
    hurry, which nothing read any more, and a third was needed."""
    with fake_upstream(FakeUpstream("ok")) as url, gateway([url], drain_timeout_s=5) as (gw, _):
        gw.server.handle_exit(signal.SIGTERM, None)
        deadline = time.monotonic() + 10
        while not gw.server.should_exit and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gw.server.should_exit and not gw.server.force_exit  # drained: nothing in flight
        time.sleep(SAME_SIGNAL_S)
        gw.server.handle_exit(signal.SIGTERM, None)
        assert gw.server.force_exit
