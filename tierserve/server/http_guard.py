"""uvicorn's HTTP/1.1 protocol with bounded work per connection (the limits of http_limits.py).

uvicorn bounds neither the size of a request's headers nor the time to send them or the
body, nor the number of open connections. This protocol does, before any application code
runs, and answers in OpenAI's error envelope with `connection: close`:

* headers larger than `max_header_bytes` (counted on the raw bytes, before the parser
  buffers them) or more than `max_headers` fields: 431;
* headers not complete `header_timeout_s` after the connection opened, or after the first
  byte of a later request on it: 408;
* a body not complete `body_timeout_s` after its headers, or cut short by the client's
  end of stream (a body shorter than its Content-Length, a chunked body without its end): 400;
* a reply the client reads none of for `send_timeout_s` (the socket's send buffer full
  all that time): the connection is closed, its request aborted;
* a connection beyond `max_connections`: 503, unless an open connection has done nothing
  for a second (idle between requests, or waiting for a request's headers): the one quiet
  longest is closed instead (408 if it waited for headers), counted as `evicted`;
* a transfer coding other than `chunked` (`Transfer-Encoding: gzip, chunked`): 501, as RFC
  9112 asks of a coding the server does not implement (the gzip was ignored, and the body
  then failed as JSON);
* bytes that are not HTTP/1.1 (a malformed request line, header or chunk framing): 400,
  where uvicorn would answer in plain text, uncounted.

A response that starts before its request's body is all in (a refusal before the body is
read: a wrong key, an unsupported type) says `connection: close` and the connection closes
once it is sent: the rest of the body is never read.

A refusal closes the connection; an application task still reading that body sees the
client gone (`http.disconnect`), and `scope[REFUSED]` says the guard ended it. A refused
request pipelined behind others is answered after them: closing at once cut off the
answers before it (the client got none of them, and the application's next write to
the closed transport logged a traceback).

An HTTP/1.0 request's response without a length (a stream) ends when the connection
closes, as HTTP/1.0 has no chunked coding (RFC 9112, 6.1); uvicorn chunked it, and an
HTTP/1.0 client read the chunk sizes as part of the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tierserve.server.http_limits import HttpLimits

log = logging.getLogger("tierserve.server")

MAX_PIPELINED = 32  # requests queued on one connection behind the one being answered
EVICT_AFTER_S = 1.0  # at the connection cap, a connection that did nothing this long may be closed
CONNECTION_LIMIT = "connection_limit"
EVICTED = "evicted"  # a connection closed at the cap to make room for a new one
REFUSED = "tierserve.refused"  # scope key: the reason the guard ended this request's connection
ABORTED_UPLOAD = "aborted_upload"  # the client ended its stream (or the connection) mid-body
MALFORMED = "malformed_http"  # the parser refused the bytes
SEND_TIMEOUT = "send_timeout"  # the client read none of its reply for send_timeout_s
HEADER_END = b"\r\n\r\n"
_REASONS = {
    431: "Request Header Fields Too Large",
    408: "Request Timeout",
    400: "Bad Request",
    501: "Not Implemented",
    503: "Service Unavailable",
}


def error_bytes(status: int, message: str, code: str) -> bytes:
    # typed as the API's other errors are (errors.py): a 503 (too many connections) is the
    # server's, not the request's
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    # A 503 (too many connections) is worth retrying soon, and says so as the API's others do.
    retry = "retry-after: 1\r\n" if status == 503 else ""
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{retry}connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclass(frozen=True)
class GuardSettings:
    limits: HttpLimits
    report: Callable[[str], None] | None  # counts a refusal, by reason


class GuardedHttpProtocol(HttpToolsProtocol):
    """Bind its settings with `guarded_protocol` (uvicorn builds one instance per connection)."""

    settings: ClassVar[GuardSettings] = GuardSettings(HttpLimits(), None)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = "headers"  # "headers" (awaiting or reading them), "body", "idle"
        self._header_bytes = 0
        self._num_headers = 0
        self._tail = b""  # last bytes seen in the header phase: a terminator may straddle reads
        self._timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._refused = False
        self._refusal: bytes | None = None  # a refused pipelined request's answer, written last
        self._running: Any = None  # the request cycle being answered
        self._headers_since = 0.0  # loop time the connection began waiting for headers
        self._idle_since = 0.0  # loop time its last response was complete

    # ---- connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        too_many = len(self.connections) >= self.settings.limits.max_connections
        super().connection_made(transport)
        self._headers_since = self.loop.time()
        if too_many and not self._make_room():
            limit = self.settings.limits.max_connections
            self._refuse(503, CONNECTION_LIMIT, f"More than {limit} open connections.")
            return
        self._arm(self.settings.limits.header_timeout_s, self._header_timeout)

    def _make_room(self) -> bool:
        """At the cap, close the connection that has done nothing longest: idle between
        requests, or waiting for a request's headers, for `EVICT_AFTER_S` at least (half the
        header timeout, if less), nothing on it being answered; False where there is none.
        One client's idle sockets, or sockets that never finish their headers opened again as
        the header timeout closed them (about 51 a second), kept the cap full before any key
        was read, and every new client got 503 `connection_limit`, a load balancer's health
        checks too. The wait spares busy clients: a pooled connection idle for a moment is
        about to carry the next request (closed then, its POST failed: aiohttp and httpx do
        not retry one, and the gateway's health checks, 0.5 s apart, ejected its upstream)."""
        limits = self.settings.limits
        now = self.loop.time()
        waited_s = min(EVICT_AFTER_S, limits.header_timeout_s / 2)
        quiet = [
            (since, c)
            for c in self.connections
            if isinstance(c, GuardedHttpProtocol)
            and c is not self
            and c._phase in ("idle", "headers")
            and not c._refused
            and not c._answering()
            and not c.transport.is_closing()
            and now - (since := c._quiet_since()) >= waited_s
        ]
        if not quiet:
            return False
        since, victim = min(quiet, key=lambda pair: pair[0])
        if victim._phase == "idle":
            victim._close_idle()
            return True
        waited = f"{now - since:.1f} s"
        cap = f"{limits.max_connections} open connections"
        victim._refuse(408, EVICTED, f"Request headers not received in {waited}: closed at the cap of {cap}.")
        return True

    def _quiet_since(self) -> float:
        """Loop time since when this connection has done nothing: its last response, or the
        start of the headers it waits for."""
        return self._idle_since if self._phase == "idle" else self._headers_since

    def _close_idle(self) -> None:
        """Close this idle keep-alive connection to make room (no request of it is pending, so
        nothing is answered)."""
        self._refused = True
        self._disarm()
        self.transport.close()
        if self.settings.report is not None:
            self.settings.report(EVICTED)
        log.debug("HTTP connection from %s closed idle at the connection cap", self.client)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_send_timer()
        # uvicorn tells only its newest request (`self.cycle`) that the client went; the one
        # being answered, and those queued behind it, are told here. Untold, a stream went on
        # writing to the closed transport (a traceback) and a whole reply's generation ran
        # to its end for nobody.
        for cycle in (self._running, *(queued for queued, _ in self.pipeline)):
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The socket's send buffer is full: the client reads slower than the reply comes.
        A client that reads nothing more for `send_timeout_s` loses the connection: one that
        stopped reading held it (and its seat under the cap, and behind the gateway an
        upstream's) for as long as the process ran, its finished reply's megabytes queued."""
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.settings.limits.send_timeout_s, self._send_timeout)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_send_timer()

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timeout(self) -> None:
        """Close without flushing (what is queued would never be read): `connection_lost`
        tells the request being answered that its client went, which aborts it."""
        self._send_timer = None
        if self.settings.report is not None:
            self.settings.report(SEND_TIMEOUT)
        wait = self.settings.limits.send_timeout_s
        log.info("HTTP connection from %s closed: its client read nothing for %g s", self.client, wait)
        self.transport.abort()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle  # the request being answered (uvicorn runs one at a time)
        super()._start_asgi_task(cycle, app)

    def eof_received(self) -> None:
        if self._phase == "body" and not self._refused:
            self._refuse(400, ABORTED_UPLOAD, "The request body ended before its declared length.")

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase == "idle":
            self._start_headers()
        if self._phase == "headers" and not self._headers_fit(data):
            limit = self.settings.limits.max_header_bytes
            self._refuse(431, "header_too_large", f"Request headers exceed {limit} bytes.")
            return
        super().data_received(data)

    def _headers_fit(self, data: bytes) -> bool:
        room = self.settings.limits.max_header_bytes - self._header_bytes
        if len(data) > room and HEADER_END not in self._tail + data[: max(room, 0) + len(HEADER_END)]:
            return False
        self._header_bytes += len(data)
        self._tail = data[-(len(HEADER_END) - 1) :]
        return True

    # ---- parser callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._refused:
            return
        if self._phase == "idle":  # a pipelined request, begun inside one read
            self._start_headers()
        if len(self.pipeline) >= MAX_PIPELINED:
            # uvicorn queues pipelined requests without a bound, and the request being
            # answered keeps the connection read: one connection queued 28,932 requests
            # (124 MB) and held them open.
            self._refuse(503, "pipeline_limit", f"More than {MAX_PIPELINED} requests pipelined.")
            return
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refused:
            return
        self._num_headers += 1
        if self._num_headers > self.settings.limits.max_headers:
            self._refuse(
                431, "too_many_headers", f"More than {self.settings.limits.max_headers} header fields."
            )
            return
        if name.lower() == b"transfer-encoding" and value.strip().lower() != b"chunked":
            coding = value.decode("latin-1")[:64]
            self._refuse(501, "unsupported_transfer_encoding", f"Transfer-Encoding {coding!r}: only chunked.")
            return
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._phase = "body"
        self._arm(self.settings.limits.body_timeout_s, self._body_timeout)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.scope is self.scope:
            self._close_if_answered_unread(cycle)
            if self.scope["http_version"] == "1.0":
                _close_delimited(cycle)

    def _close_if_answered_unread(self, cycle: Any) -> None:
        """Answer `cycle` with `connection: close`, and close once it is answered, when its
        response starts before its body is all in: refused before the body was read (a
        wrong key, a 415, a 404), the rest of it would be read only to be skipped. Kept open,
        a refused client trickling a body under 64 KiB held its connection for the body
        timeout (30 s), not evictable at the cap: 40 such sockets kept a server of
        `max_connections = 40` answering 503 `connection_limit`, its health checks too (an
        attack trial, 2026-12-07)."""
        send = cycle.send

        async def send_closing_if_unread(message: Any) -> None:
            if message["type"] == "http.response.start" and self._phase == "body" and self.cycle is cycle:
                cycle.keep_alive = False  # uvicorn then says `connection: close`, and closes
            await send(message)

        cycle.send = send_closing_if_unread

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._phase = "idle"
        self._header_bytes = self._num_headers = 0
        self._tail = b""
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        starts_another = bool(self.pipeline)
        super().on_response_complete()
        if self._refusal is not None and not starts_another and not self.transport.is_closing():
            self.transport.write(self._refusal)  # every answer before it is out
            self._refusal = None
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses, in the API's envelope and counted."""
        self._refuse(400, MALFORMED, "The request is not valid HTTP/1.1.")

    # ---- timers and refusals -------------------------------------------------------------

    def _start_headers(self) -> None:
        self._phase = "headers"
        self._headers_since = self.loop.time()
        self._arm(self.settings.limits.header_timeout_s, self._header_timeout)

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, callback)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _header_timeout(self) -> None:
        self._timer = None
        if self._phase != "headers":
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request is slow while the previous one is answered: stop reading and
            # close once that answer is complete.
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        wait = self.settings.limits.header_timeout_s
        self._refuse(408, "header_timeout", f"Request headers not received within {wait:g} s.")

    def _body_timeout(self) -> None:
        self._timer = None
        if self._phase == "body":
            wait = self.settings.limits.body_timeout_s
            self._refuse(400, "body_timeout", f"Request body not received within {wait:g} s.")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer `status` (unless a response has begun) and close the connection."""
        if self._refused:
            return
        self._refused = True
        self._disarm()
        cycle = self.cycle
        if cycle is not None and self._phase == "body":
            cycle.scope[REFUSED] = reason  # type: ignore[literal-required]
        if self._phase == "body" and self._queued(cycle):
            # Its body refused while it waits its turn behind a response being written: it
            # never runs, and its refusal follows the answers before it.
            remaining = [entry for entry in self.pipeline if entry[0] is not cycle]
            self.pipeline.clear()
            self.pipeline.extend(remaining)
            self._refusal = error_bytes(status, message, reason)
        elif self._phase != "body" and self._answering():
            # A request before this one is still being answered, or waits its turn: answer
            # this one once they are (`on_response_complete`). Its bytes and any after them
            # are dropped as they come, not left unread: a client that goes meanwhile is seen.
            self._refusal = error_bytes(status, message, reason)
        else:
            answer = self._phase != "body" or (cycle is not None and not cycle.response_started)
            if answer and not self.transport.is_closing():
                self.transport.write(error_bytes(status, message, reason))
            if cycle is not None:
                cycle.disconnected = True  # the application's later writes go nowhere, quietly
            self.transport.close()
        if self.settings.report is not None:
            self.settings.report(reason)
        level = logging.DEBUG if reason in (CONNECTION_LIMIT, EVICTED) else logging.INFO  # no log flood
        log.log(level, "HTTP %d %s from %s: %s", status, reason, self.client, message)

    def _answering(self) -> bool:
        """Whether an earlier request's response is being written or waits in the pipeline."""
        cycle = self.cycle
        return bool(self.pipeline) or (cycle is not None and not cycle.response_complete)

    def _queued(self, cycle: Any) -> bool:
        """Whether `cycle` waits in uvicorn's pipeline (not started: a response before it is
        still being written)."""
        return cycle is not None and any(queued is cycle for queued, _ in self.pipeline)


def _close_delimited(cycle: Any) -> None:
    """Make uvicorn's response cycle end an HTTP/1.0 response without a length by closing the
    connection (its keep-alive is off for HTTP/1.0) instead of chunking it: the body is
    written as it comes, and the last part is the length left."""
    send = cycle.send

    async def send_unchunked(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers", [])
            if not any(name.lower() == b"content-length" for name, _ in headers):
                cycle.chunked_encoding = False
                cycle.expected_content_length = _UNKNOWN_LENGTH
        elif (
            message["type"] == "http.response.body"
            and not message.get("more_body", False)
            and cycle.expected_content_length >= _UNKNOWN_LENGTH // 2
        ):
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = send_unchunked


_UNKNOWN_LENGTH = 1 << 62  # a close-delimited body's "length" until its last part


class _DropParserWarning(logging.Filter):
    """uvicorn warns once per malformed request; the guard already logs and counts each."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != UVICORN_MALFORMED


UVICORN_MALFORMED = "Invalid HTTP request received."
_DROP_PARSER_WARNING = _DropParserWarning()


def guarded_protocol(limits: HttpLimits, report: Callable[[str], None] | None) -> type[GuardedHttpProtocol]:
    """A protocol class with these limits, for `uvicorn.Config(http=...)`."""
    settings = GuardSettings(limits, report)
    logging.getLogger("uvicorn.error").addFilter(_DROP_PARSER_WARNING)  # a filter is added once
    return type("BoundGuardedHttpProtocol", (GuardedHttpProtocol,), {"settings": settings})


def uvicorn_options(limits: HttpLimits, report: Callable[[str], None] | None) -> dict[str, Any]:
    """uvicorn settings: this protocol, the keep-alive timeout, and no WebSocket upgrades (the
    API has no WebSocket route; an upgraded connection would leave the guard's reach)."""
    return {
        "http": guarded_protocol(limits, report),
        "timeout_keep_alive": limits.keep_alive_timeout_s,
        "ws": "none",
    }
