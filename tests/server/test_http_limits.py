"""The HTTP guard against a live server on 127.0.0.1, through raw sockets: what a hostile or
broken client can hold (headers, bodies, connections) is bounded, and each refusal is one
clean response, one metric and no 500."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import re
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack
from urllib.parse import urlsplit

import httpx
import pytest

from tests.server.helpers import MODEL, LiveServer, live_server, make_state
from tierserve.server.config import parse_serve_config

LIMITS = {
    "max_header_bytes": 4096,
    "max_headers": 20,
    "header_timeout_s": 0.5,
    "body_timeout_s": 0.5,
    "keep_alive_timeout_s": 5,
    "max_connections": 12,
}
WAIT_S = 10.0  # how long a test waits for the server before calling it a hang

# Each test reads a count before and after its refusal: /metrics made at every scrape, not
# served from the last one (`metrics_max_age_s`, tests/server/test_metrics_cache.py).
FRESH_METRICS = {"metrics_max_age_s": 0.0}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = parse_serve_config({"server": {"http": LIMITS, **FRESH_METRICS}})
    with live_server(make_state(config)) as srv:
        yield srv


def connect(server: LiveServer) -> socket.socket:
    parts = urlsplit(server.url)
    sock = socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=WAIT_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (bounded by WAIT_S)."""
    out = b""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our bytes unread: a reset, after the response
            return out
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"the server did not close the connection; got {out[:200]!r}")


def status_and_code(response: bytes) -> tuple[int, str | None]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    code = json.loads(body).get("error", {}).get("code") if body.startswith(b"{") else None
    return status, code


def errors(server: LiveServer, reason: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(f'tierserve_http_errors_total{{reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def completion_head(length: int, extra: str | bytes = "") -> bytes:
    """The head of a completion request; `extra` header lines as text, or as raw bytes."""
    raw = extra if isinstance(extra, bytes) else extra.encode()
    return (
        (
            f"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n"
        ).encode()
        + raw
        + b"\r\n"
    )


def test_a_connection_that_never_finishes_its_headers_gets_408_and_is_closed(server: LiveServer) -> None:
    before = errors(server, "header_timeout")
    with connect(server) as idle, connect(server) as slow:
        slow.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n")
        assert status_and_code(read_all(slow)) == (408, "header_timeout")
        assert status_and_code(read_all(idle)) == (408, "header_timeout")  # sent nothing at all
    assert errors(server, "header_timeout") == before + 2


def test_a_slowloris_trickling_header_bytes_is_cut_off_at_the_header_timeout(server: LiveServer) -> None:
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n")
        for i in range(100):  # one byte per 50 ms would last 5 s; the timeout is 0.5 s
            try:
                sock.sendall(b"x-a%d: 1\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                return
            time.sleep(0.05)
        raise AssertionError("a trickle of header bytes kept the connection open")


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        (b"x-big: " + b"a" * 1_000_000 + b"\r\n", "header_too_large"),
        (b"".join(b"x-h%d: 1\r\n" % i for i in range(200)), "too_many_headers"),
    ],
)
def test_oversized_headers_get_431_and_are_not_buffered(
    server: LiveServer, headers: bytes, code: str
) -> None:
    with connect(server) as sock:
        # The server may stop reading past the limit: the send then fails, the answer stands.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n" + headers + b"\r\n")
        assert status_and_code(read_all(sock)) == (431, code)


def test_headers_within_the_limit_are_served(server: LiveServer) -> None:
    r = httpx.get(server.url + "/health", headers={"x-big": "a" * 3000, **{f"x-{i}": "1" for i in range(10)}})
    assert r.status_code == 200


def test_a_body_shorter_than_its_content_length_gets_400_at_the_body_timeout(server: LiveServer) -> None:
    before = errors(server, "body_timeout")
    with connect(server) as sock:
        sock.sendall(completion_head(1000) + b'{"model": "')
        assert status_and_code(read_all(sock)) == (400, "body_timeout")
    assert errors(server, "body_timeout") == before + 1
    server.wait_engine_idle()


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_size_limit_gets_413_and_the_connection_closes_unread(
    server: LiveServer, chunked: bool
) -> None:
    """Kept alive after its 413, the connection went on being read (the rest of the body
    thrown away) until the body timeout, whose 408 then counted the same request twice."""
    before = {r: errors(server, r) for r in ("body_timeout", "aborted_upload")}
    limit = 1 << 20  # the default max_body_bytes
    if chunked:
        head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        first = b"%x\r\n" % (limit + 1) + b"a" * (limit + 1) + b"\r\n"
    else:
        head, first = completion_head(10**15), b"a" * 65536
    with connect(server) as sock:
        sock.sendall(head + first)
        response = read_all(sock)
    assert status_and_code(response) == (413, "request_too_large")
    assert b"connection: close" in response.partition(b"\r\n\r\n")[0].lower()
    assert {r: errors(server, r) for r in before} == before


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"deflate"])
def test_a_transfer_coding_other_than_chunked_gets_501(server: LiveServer, coding: bytes) -> None:
    """`gzip, chunked` was taken as chunked and the gzip ignored: the body failed as JSON."""
    before = errors(server, "unsupported_transfer_encoding")
    head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: " + coding + b"\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(head + b"5\r\nhello\r\n0\r\n\r\n")
        assert status_and_code(read_all(sock)) == (501, "unsupported_transfer_encoding")
    assert errors(server, "unsupported_transfer_encoding") == before + 1


def test_a_chunked_body_without_its_end_gets_400_at_the_body_timeout(server: LiveServer) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    with connect(server) as sock:
        sock.sendall(head + b'5\r\n{"mod\r\n')
        assert status_and_code(read_all(sock)) == (400, "body_timeout")


def test_an_upload_the_client_ends_early_is_a_400_counted_once_without_a_500(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    before = errors(server, "aborted_upload")
    with connect(server) as sock:
        sock.sendall(completion_head(1000) + b'{"model": "')
        sock.shutdown(socket.SHUT_WR)  # the client's stream ends mid-body
        assert status_and_code(read_all(sock)) == (400, "aborted_upload")
    with connect(server) as sock:  # and one that resets the connection outright
        sock.sendall(completion_head(1000) + b'{"model": "')
        time.sleep(0.05)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    deadline = time.monotonic() + WAIT_S
    while errors(server, "aborted_upload") < before + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert errors(server, "aborted_upload") == before + 2
    lines = [r for r in caplog.records if "aborted" in r.getMessage() or r.exc_info]
    assert len(lines) == 2 and not any(r.exc_info for r in lines)  # one line each, no traceback


@pytest.fixture(scope="module")
def capped() -> Iterator[LiveServer]:
    """A server of 4 connections whose header and body timeouts (4 s) outlast the wait (1 s)
    after which a quiet connection may be closed at the cap."""
    limits = {**LIMITS, "max_connections": 4, "header_timeout_s": 4.0, "body_timeout_s": 4.0}
    with live_server(make_state(parse_serve_config({"server": {"http": limits, **FRESH_METRICS}}))) as srv:
        yield srv


def test_connections_past_the_cap_get_503_and_the_cap_frees_up(capped: LiveServer) -> None:
    """None of the open connections is idle or slow with its headers (each is sending its
    body): the newcomer is refused."""
    server = capped
    with ExitStack() as stack:
        held = [stack.enter_context(connect(server)) for _ in range(4)]
        for sock in held:
            sock.sendall(completion_head(1000) + b'{"model": "')
        with connect(server) as extra:
            refused = read_all(extra)
            assert status_and_code(refused) == (503, "connection_limit")
            assert json.loads(refused.partition(b"\r\n\r\n")[2])["error"]["type"] == "server_error"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError("the server did not accept connections again once the others closed")


def test_at_the_cap_a_connection_slow_with_its_headers_makes_room(capped: LiveServer) -> None:
    """One client's sockets that never finish their headers, opened again as the header
    timeout closed them, kept the cap full: every new client got 503 `connection_limit`, a
    load balancer's health checks too. The one that has waited longest is closed instead."""
    with ExitStack() as stack:
        held = [stack.enter_context(connect(capped)) for _ in range(4)]
        for sock in held:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n")  # and no more of its headers
        time.sleep(1.5)
        assert httpx.get(capped.url + "/health", timeout=WAIT_S).status_code == 200
        answers = []
        for sock in held:  # one was closed to make room; the others finish and are served
            sock.sendall(b"\r\n")
            answers.append(sock.recv(65536))
        evicted = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
        assert len(evicted) == 1 and status_and_code(
            evicted[0] + read_all(held[answers.index(evicted[0])])
        ) == (
            408,
            "evicted",
        )
        assert sum(a.startswith(b"HTTP/1.1 200") for a in answers) == 3


def test_at_the_cap_an_idle_keep_alive_connection_makes_room(capped: LiveServer) -> None:
    """Connections kept alive between requests (one cheap request per keep-alive timeout)
    held the cap as well; HTTP lets a server close an idle one, the longest idle first."""
    before = errors(capped, "evicted")  # read under the cap: a new connection at it would evict
    with ExitStack() as stack:
        held = [stack.enter_context(connect(capped)) for _ in range(4)]
        for sock in held:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(0.05)  # idle one after another: held[0] the longest
        # Idle for a moment only, a pooled connection is about to carry its next request (closed
        # then, the request failed): the newcomer waits its turn.
        assert status_and_code(read_all(stack.enter_context(connect(capped)))) == (503, "connection_limit")
        time.sleep(1.5)
        assert httpx.get(capped.url + "/health", timeout=WAIT_S).status_code == 200
        assert read_all(held[0]) == b""  # closed quietly: no request of it was pending
        held[3].sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        assert held[3].recv(65536).startswith(b"HTTP/1.1 200")
        assert errors(capped, "evicted") == before + 1


def test_pipelined_requests_are_answered_in_order(server: LiveServer) -> None:
    with connect(server) as sock:
        sock.sendall(
            b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n" * 3 + b"GET /nope HTTP/1.1\r\nhost: t\r\n\r\n"
        )
        got = b""
        deadline = time.monotonic() + WAIT_S
        while got.count(b"HTTP/1.1 ") < 4 and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            assert chunk, f"closed after {got!r}"
            got += chunk
    statuses = [int(s) for s in re.findall(rb"HTTP/1.1 (\d{3})", got)]
    assert statuses == [200, 200, 200, 404]


def _completion(stream: bool = False, version: bytes = b"1.1") -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": stream}).encode()
    head = b"POST /v1/completions HTTP/%s\r\nhost: t\r\ncontent-type: application/json\r\n" % version
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "bad", [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\n"]
)
def test_a_refused_request_pipelined_behind_others_is_answered_after_them(
    server: LiveServer, stream: bool, bad: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """The refusal closed the connection at once: the answers before it were cut off (the
    client got nothing), and the application's next write to the closed transport logged
    a traceback."""
    with caplog.at_level(logging.ERROR), connect(server) as sock:
        sock.sendall(_completion(stream) + _completion(stream) + bad)
        got = read_all(sock)
    statuses = [int(s) for s in re.findall(rb"HTTP/1.1 (\d{3})", got)]
    assert statuses[:2] == [200, 200] and statuses[2] in (400, 501), got[:600]
    if stream:
        assert got.count(b"data: [DONE]") == 2  # both streams whole
    else:
        assert got.count(b'"finish_reason"') == 2
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def slow_server() -> Iterator[LiveServer]:
    """Steps of 10 ms: a response of a few hundred tokens outlasts the body timeout (0.5 s)."""
    config = parse_serve_config({"server": {"http": LIMITS, **FRESH_METRICS}})
    with live_server(make_state(config, step_s=0.01)) as srv:
        yield srv


def _long(stream: bool) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 150, "stream": stream}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


def _statuses(got: bytes) -> list[int]:
    return [int(s) for s in re.findall(rb"HTTP/1.1 (\d{3})", got)]


@pytest.mark.parametrize("stream", [False, True])
def test_a_pipelined_body_refused_behind_a_response_is_answered_after_it(
    slow_server: LiveServer, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A request's body refused (malformed chunks, or too slow) while it waited behind a
    response being written: the 400 was written at once, into that response (the client
    lost it, or read the 400 inside the stream), and the response's next write logged a
    traceback."""
    bad = (
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\nZZZ\r\nxx\r\n"
    )
    slow_head, _, slow_body = _completion().partition(b"\r\n\r\n")
    with caplog.at_level(logging.ERROR):
        with connect(slow_server) as sock:
            sock.sendall(_long(stream) + bad)
            malformed = read_all(sock)
        with connect(slow_server) as sock:
            sock.sendall(_long(stream) + slow_head + b"\r\n\r\n" + slow_body[:5])
            time.sleep(1.0)  # past the body timeout, the rest of the body never sent
            slow = read_all(sock)
    for got in (malformed, slow):
        assert _statuses(got) == [200, 400], got[-300:]
        rest = got.partition(b"\r\n\r\n")[2]
        answer = rest.partition(b"HTTP/1.1 400")[0]
        assert b"data: [DONE]" in answer if stream else json.loads(answer)["choices"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_pipelined_body_sent_in_time_behind_a_longer_response_is_served(slow_server: LiveServer) -> None:
    """Its body arrives 50 ms after its headers, while the response before it runs past the
    body timeout: it is read meanwhile (the running request's disconnect watch keeps the
    connection read), so it is served, not refused as too slow."""
    head, _, body = _completion().partition(b"\r\n\r\n")
    with connect(slow_server) as sock:
        sock.sendall(_long(stream=True) + head + b"\r\n\r\n")
        time.sleep(0.05)
        sock.sendall(body)
        got = b""
        deadline = time.monotonic() + WAIT_S
        while got.count(b"HTTP/1.1 ") < 2 or not got.rstrip().endswith(b"}"):
            assert time.monotonic() < deadline, f"no second answer: {got[-300:]!r}"
            chunk = sock.recv(65536)
            assert chunk, f"closed after {got[-300:]!r}"
            got += chunk
    assert _statuses(got) == [200, 200] and got.count(b"data: [DONE]") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_while_a_refusal_waits_is_seen_by_the_request_being_answered(
    slow_server: LiveServer, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn tells only its newest request that the client went, here the refused one:
    the request being answered ran to its end for nobody (a whole reply) or wrote to the
    closed connection (a stream: a traceback)."""
    from tests.server.helpers import end_counts

    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 400, "stream": stream}).encode()
    long = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    long += b"content-length: %d\r\n\r\n" % len(body) + body
    head, _, rest = _completion().partition(b"\r\n\r\n")
    _, aborted_before, _ = slow_server.inspect(end_counts)
    with caplog.at_level(logging.ERROR):
        sock = connect(slow_server)
        sock.sendall(long + head + b"\r\n\r\n" + rest[:5])
        time.sleep(1.0)  # the second body's timeout passes: its refusal waits for the first answer
        sock.close()
        deadline = time.monotonic() + WAIT_S
        while slow_server.inspect(end_counts)[1] == aborted_before and time.monotonic() < deadline:
            time.sleep(0.05)
    assert slow_server.inspect(end_counts)[1] == aborted_before + 1  # 400 steps of 10 ms: not done yet
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_requests_pipelined_past_the_limit_are_refused_not_queued(server: LiveServer) -> None:
    """uvicorn queued pipelined requests without a bound: one connection held 28,932 (124 MB)."""
    from tierserve.server.http_guard import MAX_PIPELINED

    before = errors(server, "pipeline_limit")
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n" * 300)
        got = read_all(sock)  # the connection closes after the refusal
    statuses = [int(s) for s in re.findall(rb"HTTP/1.1 (\d{3})", got)]
    assert statuses[-1] == 503 and b'"pipeline_limit"' in got
    assert set(statuses[:-1]) == {200} and MAX_PIPELINED < len(statuses) < 300
    assert errors(server, "pipeline_limit") == before + 1


def test_an_http_1_0_stream_ends_with_the_connection_not_in_chunks(server: LiveServer) -> None:
    """HTTP/1.0 has no chunked coding (RFC 9112, 6.1): the client read the chunk sizes
    as part of the stream."""
    with connect(server) as sock:
        sock.sendall(_completion(stream=True, version=b"1.0"))
        got = read_all(sock)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    events = [line for line in body.split(b"\n") if line]
    assert events and all(line.startswith(b"data: ") for line in events), body[:300]
    assert events[-1] == b"data: [DONE]"
    # Not streamed, the answer has its length as before.
    with connect(server) as sock:
        sock.sendall(_completion(version=b"1.0"))
        head, _, body = read_all(sock).partition(b"\r\n\r\n")
    assert b"content-length: %d" % len(body) in head.lower() and json.loads(body)["choices"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "' + MODEL.encode() + b'", "prompt": "\xff\xfe bad utf-8"}',
        b"\xff" * 2000,
        b'{"model": "' + MODEL.encode() + b'", "prompt": [' + b"1," * 100_000 + b"1]",  # off the loop
    ],
)
def test_bodies_that_are_not_valid_utf8_or_json_are_400s(server: LiveServer, body: bytes) -> None:
    r = httpx.post(
        server.base_url + "/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"


def test_a_large_valid_body_is_served(server: LiveServer) -> None:
    ids = [255] * 5000
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "user": "u" * 70_000}  # validated off the loop
    r = httpx.post(server.base_url + "/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_header_bytes_that_are_not_utf8_are_a_400_not_a_500(server: LiveServer) -> None:
    with connect(server) as sock:
        body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
        odd = "x-tenant-id: \xff\xfe\r\nconnection: close\r\n".encode("latin-1")
        sock.sendall(completion_head(len(body), odd) + body)
        status, _ = status_and_code(read_all(sock))
    assert status in (200, 400)


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\x00\x01 / HTTP/1.1\r\n\r\n",  # not a request line
        b"GET / HTTP/1.1\r\nhost: t\r\nbad header line\r\n\r\n",  # a header without a colon
        # a chunk size that is not hex
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
)
def test_bytes_that_are_not_http_get_a_json_400_counted_and_logged_once(
    server: LiveServer, raw: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    before = errors(server, "malformed_http")
    with caplog.at_level(logging.INFO), connect(server) as sock:
        sock.sendall(raw)
        response = read_all(sock)
    assert status_and_code(response) == (400, "malformed_http")
    assert b"content-type: application/json" in response.lower()
    assert errors(server, "malformed_http") == before + 1
    lines = [r for r in caplog.records if "malformed" in r.getMessage() or "Invalid HTTP" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


@pytest.mark.parametrize("encodings", [["gzip"], ["br"], ["GZIP, deflate"], ["identity", "gzip"]])
def test_a_compressed_body_is_refused_with_415_not_parsed_as_json(
    server: LiveServer, encodings: list[str]
) -> None:
    """Every Content-Encoding header counts: a second one after `identity` went unread."""
    body = gzip.compress(json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode())
    headers = [("content-type", "application/json"), *(("content-encoding", e) for e in encodings)]
    r = httpx.post(server.base_url + "/completions", content=body, headers=headers)
    assert r.status_code == 415, r.text
    assert r.json()["error"]["code"] == "unsupported_content_encoding"


def test_an_identity_content_encoding_is_served(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    r = httpx.post(server.base_url + "/completions", json=body, headers={"content-encoding": "identity"})
    assert r.status_code == 200, r.text


def test_utf8_header_values_are_read_as_utf8(server: LiveServer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    with connect(server) as sock:
        extra = "x-tenant-id: 团队\r\nx-request-tier: réaltime\r\nconnection: close\r\n"
        sock.sendall(completion_head(len(body), extra) + body)
        response = read_all(sock)
    assert status_and_code(response)[0] == 400
    message = json.loads(response.partition(b"\r\n\r\n")[2])["error"]["message"]
    assert "'réaltime'" in message, message
    with connect(server) as sock:
        sock.sendall(completion_head(len(body), "x-tenant-id: 团队\r\nconnection: close\r\n") + body)
        assert status_and_code(read_all(sock))[0] == 200
