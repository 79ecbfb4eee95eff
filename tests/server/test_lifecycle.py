"""Disconnects, draining, and the engine loop under concurrent mixed-tier load."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.server.helpers import MODEL, end_counts, live_server, make_state, pool_free_and_total, pool_in_use
from tests.server.test_http_limits import completion_head, read_all, status_and_code
from tierserve.engine import Engine
from tierserve.server.drain import SAME_SIGNAL_S

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


def _aborted_and_generated(engine: Engine) -> tuple[int, int]:
    return engine.stats.num_aborted, engine.stats.num_generated_tokens


def test_a_disconnected_stream_is_aborted_and_frees_its_blocks() -> None:
    with live_server(make_state()) as srv:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "stream": True}
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert srv.inspect(pool_in_use)
        srv.wait_engine_idle(timeout_s=5)
        free, total = srv.inspect(pool_free_and_total)
        assert free == total
        stats = srv.inspect(_aborted_and_generated)
        assert stats[0] == 1 and stats[1] < 3000
        assert "tierserve_client_disconnects_total 1.0" in httpx.get(srv.url + "/metrics").text


def test_a_disconnected_non_streaming_request_is_aborted_too() -> None:
    with live_server(make_state()) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                srv.base_url + "/chat/completions",
                timeout=0.3,
                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3000},
            )
        srv.wait_engine_idle(timeout_s=5)
        assert srv.inspect(end_counts)[1] == 1


def test_drain_refuses_new_requests_and_lets_running_ones_finish() -> None:
    with live_server(make_state(), drain_timeout_s=20) as srv:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 600, "stream": True}
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            srv.begin_drain()
            time.sleep(0.05)
            refused = httpx.post(
                srv.base_url + "/chat/completions", json={"model": MODEL, "messages": MESSAGES}
            )
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            assert httpx.get(srv.url + "/ready").status_code == 503
            assert httpx.get(srv.url + "/health").status_code == 200
            rest = [line for line in lines if line.startswith("data: {")]
        assert json.loads(rest[-1][6:])["choices"][0]["finish_reason"] == "length"
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive()  # it shut itself down once drained


def test_a_request_still_uploading_when_the_drain_begins_gets_503_draining_unread() -> None:
    """With nothing in the engine the drain ended at once, and uvicorn then cancelled the
    handler still waiting for its body: a plain-text 500 and a traceback in the log."""
    with live_server(make_state(), drain_timeout_s=20) as srv:
        parts = urlsplit(srv.url)
        with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=10) as sock:
            sock.sendall(completion_head(1000) + b'{"model": "')  # and no more of it
            time.sleep(0.2)
            srv.begin_drain()
            response = read_all(sock)
        assert status_and_code(response) == (503, "draining")
        assert b"connection: close" in response.lower()
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive() and srv.server.exit_code == 0


def test_a_drain_that_begins_while_a_request_waits_for_its_limits_refuses_it() -> None:
    """The drain waits for the requests in the engine; one that passed the first draining
    check and was still being prepared or rate-limited reached the engine after the drain
    had begun (and found it idle)."""
    state = make_state()
    acquire = state.limiter.acquire

    async def acquire_while_the_drain_begins(*args: object, **kwargs: object) -> object:
        state.begin_draining()
        return await acquire(*args, **kwargs)  # type: ignore[arg-type]

    state.limiter.acquire = acquire_while_the_drain_begins  # type: ignore[method-assign]
    with live_server(state) as srv:
        r = httpx.post(srv.base_url + "/chat/completions", json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert srv.inspect(end_counts) == (0, 0, 0)  # the engine never saw it


def test_a_second_signal_cuts_the_drain_short_with_clean_errors() -> None:
    """SIGTERM drains; a second one aborts what is left at once, each stream ending with
    the drain timeout's error event (not a cut connection), and the server exits."""
    with live_server(make_state(), drain_timeout_s=60) as srv:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            started = time.monotonic()
            srv.signal()
            srv.signal()  # the same signal again at once (GNU timeout sends two): counted once
            time.sleep(SAME_SIGNAL_S + 0.1)
            assert srv.thread.is_alive() and not srv.server.should_exit  # still draining
            srv.signal()
            rest = [line for line in lines if line]
        assert time.monotonic() - started < 20  # not the 60 s drain
        assert any('"code": "aborted"' in line for line in rest) and rest[-1] == "data: [DONE]"
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive() and srv.server.exit_code == 0


def test_drain_timeout_aborts_what_is_left_and_exits() -> None:
    with live_server(make_state(), drain_timeout_s=0.3) as srv:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            srv.begin_drain()
            rest = [line for line in lines if line]
        assert any('"code": "aborted"' in line for line in rest) and rest[-1] == "data: [DONE]"
        srv.thread.join(timeout=10)
        assert not srv.thread.is_alive()


def test_a_stream_cut_by_the_drain_reports_its_usage_before_the_error() -> None:
    """A client (or a gateway metering the stream) that asked for usage learns what the cut
    stream used: the usage chunk comes before the error event, where OpenAI's client stops
    reading. Without it a gateway charged the whole reservation."""
    with live_server(make_state(), drain_timeout_s=0.3) as srv:
        body = {
            "model": MODEL,
            "messages": MESSAGES,
            "max_tokens": 4000,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", srv.base_url + "/chat/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line)
            events = [next(lines), next(lines)]  # the role, then a first token
            srv.begin_drain()
            events += lines
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    (usage_at,) = [i for i, p in enumerate(payloads) if p.get("usage")]
    (error_at,) = [i for i, p in enumerate(payloads) if "error" in p]
    assert usage_at == error_at - 1 and events[-1] == "data: [DONE]"
    usage = payloads[usage_at]["usage"]
    num_text_chunks = sum(
        1 for p in payloads[:usage_at] if p["choices"] and p["choices"][0]["delta"].get("content")
    )
    assert payloads[usage_at]["choices"] == [] and usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] >= num_text_chunks >= 1


def test_a_non_streaming_request_cut_at_the_drain_timeout_is_a_503_said_once() -> None:
    """Its message read "The request was aborted: aborted"."""
    with live_server(make_state(), drain_timeout_s=0.3) as srv:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4000}
        answers: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answers.append(
                httpx.post(srv.base_url + "/chat/completions", json=body, timeout=30)
            )
        )
        sender.start()
        deadline = time.monotonic() + 10
        while not srv.state.engine.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        srv.begin_drain()
        sender.join(timeout=30)
    (r,) = answers
    error = r.json()["error"]
    assert r.status_code == 503 and error["code"] == "aborted", r.text
    assert error["message"] == "The request was aborted."
