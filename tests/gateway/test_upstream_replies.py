"""What the client gets when an upstream's reply is not what an OpenAI-compatible server
should send: a stream that stops without `data: [DONE]`, a refusal outside OpenAI's error
envelope, a 200 that is not JSON. Found by probing the gateway with a misbehaving upstream."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import tomllib
from functools import partial
from typing import Any

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
from tierserve.config import ConfigError
from tierserve.gateway import forward
from tierserve.gateway.config import parse_gateway_config
from tierserve.gateway.usage import (
    MAX_QUOTED_CHARS,
    EventTooLarge,
    ReplyRead,
    SseUsageTap,
    read_reply,
    usage_of,
)

UNUSED_URL = "http://127.0.0.1:1"
CHAT = {"model": FAKE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_stream_the_upstream_ends_without_done_ends_with_an_error_event_and_done() -> None:
    """It was passed on as a clean end: two events, no error, no `[DONE]`, counted `ok`."""
    with (
        fake_upstream(FakeUpstream("stop")) as url,
        gateway([url]) as (gw, state),
    ):
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30
        ) as r:
            text = r.read().decode()
        metrics = httpx.get(gw.url + "/metrics").text
    events = [e for e in text.split("\n\n") if e]
    assert '"t0"' in events[0] and '"t1"' in events[1] and len(events) == 4, text
    assert '"code": "upstream_failed"' in events[2] and events[3] == "data: [DONE]"
    assert 'tierserve_gateway_upstream_requests_total{outcome="broken",upstream="f0"} 1.0' in metrics
    assert state.num_in_flight == 0


def test_the_usage_tap_notes_done_and_ends_a_last_event_without_its_blank_line() -> None:
    tap = SseUsageTap(forward_usage=False)
    assert tap.feed(b'data: {"choices": []}\n\ndata: {"cho') == b'data: {"choices": []}\n\n'
    # Cut inside a line: half a JSON chunk, on which the OpenAI client raised JSONDecodeError
    # before it could read the error event after it. Dropped.
    assert tap.flush() == b"" and not tap.done
    tap = SseUsageTap(forward_usage=False)
    assert tap.feed(b'data: {"choices": []}\n') == b""
    assert tap.flush() == b'data: {"choices": []}\n\n'  # whole lines: ended, apart from what follows
    for last in (b"data: [DONE]\n\n", b"data: [DONE]\n", b"data:[DONE]"):
        tap = SseUsageTap(forward_usage=False)
        assert tap.feed(last) + tap.flush() == last.rstrip(b"\n") + b"\n\n" and tap.done, last


@pytest.mark.parametrize(
    ("status", "body", "media", "message"),
    [
        (429, b'{"detail": "slow down"}', "application/json", "slow down"),  # FastAPI's shape
        (400, b'{"object": "error", "message": "bad n"}', "application/json", "bad n"),  # older vLLM
        (429, b"<html>Too Many Requests</html>", "text/html", "<html>Too Many Requests</html>"),
        (413, b'{"what": 1}', "application/json", '{"what": 1}'),
    ],
)
def test_an_upstream_refusal_reaches_the_client_in_openais_envelope_with_its_retry_after(
    status: int, body: bytes, media: str, message: str
) -> None:
    """It was passed on as the upstream wrote it (`{"detail": ...}`, HTML) and without its
    Retry-After."""
    fake = FakeUpstream("refuse", refusal_status=status, refusal_body=body, refusal_type=media)
    with fake_upstream(fake) as url, gateway([url]) as (gw, state):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == status and r.headers["retry-after"] == "7"
    error = r.json()["error"]
    assert error["message"] == message and error["code"] == "upstream_error", r.text
    assert r.headers["x-tierserve-tier"] == "P1" and state.num_in_flight == 0


def test_an_upstream_refusal_in_openais_envelope_is_passed_on_as_written() -> None:
    body = b'{"error": {"message": "no such model", "type": "NotFoundError", "code": 404}}'
    fake = FakeUpstream("refuse", refusal_status=404, refusal_body=body)
    with fake_upstream(fake) as url, gateway([url]) as (gw, _):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 404 and r.content == body and r.headers["retry-after"] == "7"


@pytest.mark.parametrize("stream", [False, True])
def test_a_200_that_is_not_the_reply_asked_for_is_retried_elsewhere_and_never_reaches_the_client(
    stream: bool,
) -> None:
    """An HTML page with status 200 (a proxy's, say) reached the client as the answer; and
    streamed, it was passed on as if it were events, then an `upstream_failed` event: the
    request was not tried elsewhere."""
    html = FakeUpstream(
        "refuse", refusal_status=200, refusal_body=b"<html>oops</html>", refusal_type="text/html"
    )
    good = FakeUpstream("ok")
    asked = {**CHAT, "stream": stream}
    with fake_upstream(html) as html_url, fake_upstream(good) as good_url:
        with gateway([html_url, good_url]) as (gw, _):
            answers = [
                httpx.post(
                    gw.url + "/v1/chat/completions",
                    json={**asked, "messages": [{"role": "user", "content": f"prefix {i}"}]},
                    timeout=30,
                )
                for i in range(6)
            ]
        with gateway([html_url]) as (gw, state):
            alone = httpx.post(gw.url + "/v1/chat/completions", json=asked, timeout=30)
            assert state.num_in_flight == 0
    assert len(html.bodies) > 1 and [r.status_code for r in answers] == [200] * 6
    if stream:
        assert all("oops" not in r.text and r.text.endswith("data: [DONE]\n\n") for r in answers)
        assert all("upstream_failed" not in r.text for r in answers), [r.text for r in answers]
    else:
        assert all(r.json()["choices"][0]["message"]["content"] == "ok" for r in answers)
    assert alone.status_code == 502 and alone.json()["error"]["code"] == "upstream_unavailable"


def test_a_redis_unreachable_at_start_up_is_said_in_one_line_and_exported_as_down(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing was said until the first request, and `tierserve_ratelimit_redis_up` read 1."""
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = (
        f'[server.ratelimit]\nbackend = "redis"\nredis_url = "redis://:secret@127.0.0.1:{port}/9"\n'
        '[gateway.redis_fail]\nP2 = "closed"\n'
    )
    with (
        caplog.at_level(logging.WARNING),
        fake_upstream(FakeUpstream("ok")) as url,
        gateway([url], extra=extra) as (gw, _),
    ):
        metrics = httpx.get(gw.url + "/metrics").text
    lines = [r.getMessage() for r in caplog.records if "unreachable at start-up" in r.getMessage()]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "secret" not in lines[0], lines
    assert "P1 open, P2 closed" in lines[0]
    assert "tierserve_ratelimit_redis_up 0.0" in metrics


def test_an_upstream_silent_past_the_read_timeout_fails_instead_of_holding_the_request() -> None:
    """A replica that took a request and never answered held it until the client left. The
    request fails alone (a 504, stopped upstream: its connection is closed)."""
    silent = FakeUpstream("ok", reply_after_s=60.0)
    with fake_upstream(silent) as url, gateway([url], extra="read_timeout_s = 0.5") as (gw, state):
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout", r.text
        assert state.num_in_flight == 0
        for _ in range(500):  # the upstream sees its client go (bounded: 10 s)
            if silent.num_clients_gone:
                break
            time.sleep(0.02)
        assert silent.num_clients_gone == 1
    stalled = FakeUpstream("ok", event_gap_s=60.0)  # the first event, then nothing for a minute
    with fake_upstream(stalled) as url, gateway([url], extra="read_timeout_s = 0.5") as (gw, state):
        with httpx.stream(
            "POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=30
        ) as r:
            events = [e for e in r.read().decode().split("\n\n") if e]
        assert '"t0"' in events[0] and '"code": "upstream_failed"' in events[1], events
        assert events[-1] == "data: [DONE]" and len(events) == 3 and state.num_in_flight == 0


def test_an_upstream_that_wants_an_api_key_gets_it_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway sent no key upstream: a vLLM started with --api-key was never admitted."""
    fake = FakeUpstream("ok", api_key="sk-upstream")
    monkeypatch.setenv("UPSTREAM_KEY", "sk-upstream")
    with fake_upstream(fake) as url:
        ups = f'\n[[upstreams]]\nkind = "vllm"\nurl = "{url}"\napi_key_env = "UPSTREAM_KEY"\n'
        config = parse_gateway_config(tomllib.loads(f"[gateway]\nscrape_interval_s = 0.2\n{ups}"))
        assert "sk-upstream" not in repr(config)
        with gateway_of(config) as (gw, _):
            r = httpx.post(
                gw.url + "/v1/chat/completions",
                json=CHAT,
                headers={"authorization": "Bearer client"},
                timeout=30,
            )
            assert r.status_code == 200, r.text
    assert fake.headers[-1]["authorization"] == "Bearer sk-upstream"  # its key, not the client's
    monkeypatch.delenv("UPSTREAM_KEY")
    with pytest.raises(ConfigError, match=r"upstreams\[0\]\.api_key_env: .*UPSTREAM_KEY is not set"):
        parse_gateway_config(tomllib.loads(ups))


def test_the_usage_tap_gives_the_same_events_however_the_stream_is_cut() -> None:
    """CRLF line ends split between two chunks ("\r" | "\n") made a stream of no events: it
    was held whole to its end and then called broken."""
    events = [b'data: {"choices": [{"text": "%d"}]}\n\n' % i for i in range(30)] + [b"data: [DONE]\n\n"]
    raw = b"".join(events)
    for line_end in (b"\n", b"\r\n"):
        data = raw.replace(b"\n", line_end)
        for size in (1, 2, 3, 7, 64):
            tap = SseUsageTap(forward_usage=True)
            outs = [tap.feed(data[i : i + size]) for i in range(0, len(data), size)]
            assert b"".join(outs) + tap.flush() == raw and tap.done, (line_end, size)
            if size == 1:  # each event as its last byte comes, not held to the end
                assert sum(1 for out in outs if out) == len(events)


def test_an_event_past_the_limit_ends_the_stream_instead_of_filling_memory() -> None:
    tap = SseUsageTap(forward_usage=True, max_event_bytes=1000)
    assert tap.feed(b"data: " + b"x" * 600) == b""
    with pytest.raises(EventTooLarge, match="over 1,000 bytes"):
        tap.feed(b"x" * 600)


def test_a_stream_without_its_first_event_in_the_read_timeout_fails_alone_and_ejects_nothing() -> None:
    """Headers, then no event for `read_timeout_s` (a long queue there, say) ejected the
    upstream and sent the request to another, which ran it again: the stream is a 504 of its
    own, not retried, and its upstream, whose checks pass, stays in."""
    mute, good = FakeUpstream("ok", first_event_after_s=60.0), FakeUpstream("ok")
    with gateway_over(mute, good, extra="read_timeout_s = 0.5") as gw:
        codes = []
        for i in range(4):
            body = spread_body(CHAT, i, stream=True)
            with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
                r.read()
                codes.append(r.status_code)
                if r.status_code == 504:
                    assert r.json()["error"]["code"] == "upstream_timeout", r.text
        metrics = httpx.get(gw.url + "/metrics").text
    assert mute.bodies, "no request went to the mute upstream"
    assert sorted(codes) == [200] * len(good.bodies) + [504] * len(mute.bodies)  # none sent twice
    assert metric_counts(metrics, "tierserve_gateway_upstream_ejections", "upstream") == {}
    assert metric_counts(metrics, "tierserve_gateway_upstream_requests", "outcome")["timeout"] == len(
        mute.bodies
    )


@pytest.mark.parametrize("status", [302, 307])
def test_an_upstream_redirect_is_not_followed_and_another_upstream_answers(status: int) -> None:
    """A 307 was followed: the prompt, tier and tenant went to the host it named, whose answer
    came back as the upstream's and counted `ok`; a 302 turned the POST into a GET (405)."""
    elsewhere = FakeUpstream("ok")
    with fake_upstream(elsewhere) as elsewhere_url:
        redirecting = FakeUpstream(
            "refuse", refusal_status=status, location=elsewhere_url + "/v1/chat/completions"
        )
        with fake_upstream(redirecting) as bad, fake_upstream(FakeUpstream("ok")) as good:
            with gateway([bad, good], extra="ejection_hold_s = 30") as (gw, _):
                replies = [
                    httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30) for _ in range(4)
                ]
                metrics = httpx.get(gw.url + "/metrics").text
            with gateway([bad]) as (gw, _):  # the only upstream: the redirect is its failure
                alone = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert [r.status_code for r in replies] == [200] * 4 and redirecting.bodies
    assert 'outcome="ok",upstream="f0"} 0.0' in metrics
    assert alone.status_code == 502, alone.text
    assert not elsewhere.bodies  # nothing went where the redirects pointed


def test_idle_upstream_connections_are_closed_before_the_upstreams_close_them() -> None:
    """aiohttp kept an idle connection for 15 s, an upstream under uvicorn closes it after 5:
    a request sent on one the upstream had just closed failed (ServerDisconnectedError), a
    502 where the model had one upstream, on every other request 1.3 s apart in a trial."""
    import asyncio

    import uvicorn

    from tierserve.gateway.state import UPSTREAM_KEEPALIVE_S
    from tierserve.server.http_limits import HttpLimits

    assert (
        min(HttpLimits().keep_alive_timeout_s, uvicorn.Config(None).timeout_keep_alive) > UPSTREAM_KEEPALIVE_S
    )
    config = parse_gateway_config(tomllib.loads(f'[[upstreams]]\nkind = "vllm"\nurl = "{UNUSED_URL}"\n'))

    async def keepalive() -> float:
        from types import SimpleNamespace

        from tierserve.gateway.state import GatewayState

        state = SimpleNamespace(config=config, streams=None)
        session = GatewayState.open_streams(state)  # type: ignore[arg-type]
        try:
            return float(session.connector._keepalive_timeout)  # type: ignore[union-attr]
        finally:
            await session.close()

    assert asyncio.run(keepalive()) == UPSTREAM_KEEPALIVE_S


def test_a_reply_is_read_for_what_the_gateway_needs_of_it() -> None:
    usage = b'"usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}'
    read = read_reply("completion", b'{"choices": [], ' + usage + b"}")
    assert read.is_object and not read.error_envelope and read.usage and read.usage.total == 7
    assert read.message == ""
    assert read_reply("completion", b"<html>oops</html>") == ReplyRead(False, False, None, "")
    assert read_reply("completion", b"[1, 2]", status=500).message == "[1, 2]"
    assert read_reply("completion", b'{"detail": "slow down"}', status=429).message == "slow down"
    envelope = read_reply("completion", b'{"error": {"message": "no"}}', status=404)
    assert envelope.error_envelope and envelope.message == ""
    long = read_reply("completion", b'{"what": "' + b"x" * 5000 + b'"}', status=400)
    assert len(long.message) == MAX_QUOTED_CHARS and long.message.startswith('{"what": "xx')
    assert not read_reply("completion", b"[" * 100_000).is_object  # too deep: not an object


def test_a_large_reply_is_read_off_the_event_loop_and_passed_on_intact() -> None:
    """A non-streaming answer with logprobs runs to megabytes; json.loads on the gateway's
    event loop held every stream it carries for as long."""
    logprobs = [{"token": f"t{i}", "logprob": -0.5} for i in range(20_000)]
    body = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "ok"}, "logprobs": logprobs}
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 20_000, "total_tokens": 20_003},
        }
    ).encode()
    assert len(body) > forward.REPLY_OFFLOAD_BYTES
    fake = FakeUpstream("refuse", refusal_status=200, refusal_body=body)
    with fake_upstream(fake) as url, gateway([url]) as (gw, state):
        jobs: list[int] = []
        run = state.body_parser.run

        async def spy(job: Any, kind: Any, raw: bytes, **options: Any) -> Any:
            jobs.append(len(raw))
            return await run(job, kind, raw, **options)

        state.body_parser.run = spy  # type: ignore[method-assign]
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200 and r.content == body
    assert jobs == [len(body)] and state.num_in_flight == 0


@pytest.mark.parametrize(
    ("prompt", "completion", "total"),
    [(3, 4, 7), (0, 0, 0), (True, True, None), (-500_000, 4, None), (10**400, 1, None), (3, "4", None)],
)
def test_a_usage_that_is_not_a_token_count_counts_as_none(
    prompt: object, completion: object, total: object
) -> None:
    """A count of a billion left every tenant's tokens in debt for hours; a negative one
    refunded tokens; `true` counted as 1; one of 400 digits failed the settling."""
    usage = usage_of({"usage": {"prompt_tokens": prompt, "completion_tokens": completion}})
    assert (usage.total if usage else None) == total


def test_a_background_task_that_fails_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    from tierserve.gateway.state import build_gateway_state

    upstream = f'[[upstreams]]\nname = "f0"\nkind = "vllm"\nurl = "{UNUSED_URL}"\n'
    state = build_gateway_state(parse_gateway_config(tomllib.loads(upstream)))

    async def fails() -> None:
        raise OverflowError("int too large to convert to float")

    async def scenario() -> None:
        state.spawn(fails())
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.ERROR, logger="tierserve.gateway"):
        asyncio.run(scenario())
    (record,) = [r for r in caplog.records if "background task failed" in r.getMessage()]
    assert record.exc_info and record.exc_info[0] is OverflowError


USAGE_JSON = b'{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}'


@pytest.mark.parametrize(
    "event",
    [
        b"data: " + USAGE_JSON + b"\n\n",
        b"data:" + USAGE_JSON + b"\n\n",  # no space after the colon: the same event (SSE)
        b"id: 7\nevent: message\ndata: " + USAGE_JSON + b"\n\n",
        b"data:  " + USAGE_JSON + b"\n\n",  # two spaces: the data starts with one
        b": a comment\ndata: " + USAGE_JSON[:15] + b"\ndata: " + USAGE_JSON[15:] + b"\n\n",  # two data lines
    ],
    ids=["usual", "no-space", "id-and-event", "two-spaces", "two-lines"],
)
def test_the_usage_event_is_read_in_any_of_the_shapes_sse_allows(event: bytes) -> None:
    """Only `data: {` was read: the usage went uncounted (the reservation charged whole), and
    the usage-only event the client did not ask for reached it (`chunk.choices[0]` fails)."""
    tap = SseUsageTap(forward_usage=False)
    assert tap.feed(b'data: {"choices": [{"index": 0}], "usage": null}\n\n' + event) != b""
    assert tap.usage is not None and tap.usage.total == 8
    kept = SseUsageTap(forward_usage=True)
    assert kept.feed(event) == event and kept.usage is not None
    done = SseUsageTap(forward_usage=False)
    assert done.feed(b"id: 9\ndata:[DONE]\n\n") and done.done
    last = SseUsageTap(forward_usage=False)  # the last event, without its line end
    assert last.feed(b"id: 9\ndata: [DONE]") == b"" and last.flush() == b"id: 9\ndata: [DONE]\n\n"
    assert last.done and last.feed(b"data: {}\n\n") + last.flush() == b""


def test_an_upstream_ejected_while_its_whole_reply_is_parsed_does_not_send_the_request_again() -> None:
    """The reply was in hand, but its attempt still counted as awaiting one: an ejection
    while the worker parsed it cut the attempt, and the request was answered by a second
    upstream too."""
    body = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode()
    body = body[:-1] + b', "pad": "' + b"x" * (forward.REPLY_OFFLOAD_BYTES + 1) + b'"}'
    fakes = [FakeUpstream("refuse", refusal_status=200, refusal_body=body) for _ in range(2)]
    with fake_upstream(fakes[0]) as u0, fake_upstream(fakes[1]) as u1, gateway([u0, u1]) as (gw, state):
        run = state.body_parser.run

        async def ejecting(job: Any, kind: Any, raw: bytes, **options: Any) -> Any:
            (served,) = [f"f{i}" for i, fake in enumerate(fakes) if fake.bodies]
            # From outside the attempt (a health check's, say): the attempt that ejects an
            # upstream itself goes on.
            eject = partial(state.record_failure, served, "silent", eject_now=True, unresponsive=True)
            asyncio.get_running_loop().call_soon(eject)
            await asyncio.sleep(0.05)
            return await run(job, kind, raw, **options)

        state.body_parser.run = ejecting  # type: ignore[method-assign]
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200 and r.content == body
    assert sum(len(fake.bodies) for fake in fakes) == 1
