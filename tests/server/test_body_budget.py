"""The bytes all request bodies may be uploading at once are bounded (`max_buffered_body_bytes`):
each open connection could otherwise hold a body of the largest size."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from tierserve.config import ConfigError
from tierserve.server.body_limit import MESSAGE_COST, UNCHARGED_BYTES, BodyBudgetSpent, BodyLimitMiddleware
from tierserve.server.config import parse_serve_config

Message = dict[str, object]


def _scope(headers: list[tuple[bytes, bytes]]) -> dict[str, object]:
    return {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}


def _chunks(*parts: bytes) -> Callable[[], Awaitable[Message]]:
    """The ASGI receive channel of a body sent in `parts`, then a disconnect."""
    queue: list[Message] = [
        {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
        for i, part in enumerate(parts)
    ]

    async def receive() -> Message:
        await asyncio.sleep(0)
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    return receive


async def _noop_send(_message: Message) -> None:
    return None


def test_a_body_whose_size_would_pass_what_is_left_is_refused_unread_and_the_budget_comes_back() -> None:
    """A first upload of 600 bytes holds what has arrived of it (300 bytes) in an 800-byte
    budget: a second of 600 would pass what is left, and is refused before a byte of it is
    read; once the first is in, it fits."""

    async def scenario() -> None:
        first_reading = asyncio.Event()
        finish_first = asyncio.Event()
        read_by_second: list[int] = []

        async def app(
            scope: dict[str, object], receive: Callable[[], Awaitable[Message]], send: object
        ) -> None:
            if scope["path"] == "/first":
                message = await receive()  # the first part: the body is being uploaded
                first_reading.set()
                await finish_first.wait()
                while message.get("more_body"):
                    message = await receive()
                return
            message = await receive()
            read_by_second.append(len(message.get("body", b"")))  # type: ignore[arg-type]

        middleware = BodyLimitMiddleware(app, max_bytes=800, max_buffered_bytes=800, uncharged_bytes=0)  # type: ignore[arg-type]
        headers = [(b"content-length", b"600")]
        first = asyncio.create_task(
            middleware({**_scope(headers), "path": "/first"}, _chunks(b"x" * 300, b"x" * 300), _noop_send)
        )
        await first_reading.wait()
        assert middleware.budget is not None and middleware.budget.held == 300
        with pytest.raises(BodyBudgetSpent):
            await middleware(_scope(headers), _chunks(b"y" * 600), _noop_send)
        assert read_by_second == [], "the refused body was read"
        finish_first.set()
        await first
        assert middleware.budget.held == 0
        await middleware(_scope(headers), _chunks(b"y" * 600), _noop_send)
        assert read_by_second == [600] and middleware.budget.held == 0

    asyncio.run(scenario())


def test_bodies_that_stall_hold_only_what_they_sent() -> None:
    """64 connections that each sent one byte of a 1 MiB body, chunked or not, and stalled
    took the whole 64 MiB budget when a body reserved its size: every other body, a 50-byte
    P0 request too, got 503 `busy` for the body timeout (an attack trial)."""

    async def scenario() -> None:
        stalled = asyncio.Event()
        read: list[int] = []

        async def app(
            scope: dict[str, object], receive: Callable[[], Awaitable[Message]], send: object
        ) -> None:
            message = await receive()
            if scope["path"] == "/stall":
                await stalled.wait()
                return
            read.append(len(message.get("body", b"")))  # type: ignore[arg-type]

        middleware = BodyLimitMiddleware(app, max_bytes=1000, max_buffered_bytes=1000, uncharged_bytes=100)  # type: ignore[arg-type]
        stalls = [
            asyncio.create_task(
                middleware({**_scope(headers), "path": "/stall"}, _chunks(b"s" * 101, b"s"), _noop_send)
            )
            for headers in [[(b"content-length", b"1000")], [(b"transfer-encoding", b"chunked")]] * 20
        ]
        await asyncio.sleep(0.01)
        assert middleware.budget is not None and middleware.budget.held == 40  # 1 byte past 100 each
        await middleware(_scope([(b"content-length", b"50")]), _chunks(b"p" * 50), _noop_send)
        assert read == [50]
        stalled.set()
        await asyncio.gather(*stalls)
        assert middleware.budget.held == 0

    asyncio.run(scenario())


def test_a_body_that_grows_past_the_budget_is_cut_off_and_gives_back_what_it_held() -> None:
    async def scenario() -> None:
        async def app(scope: object, receive: Callable[[], Awaitable[Message]], send: object) -> None:
            message = await receive()
            while message.get("more_body"):
                message = await receive()

        middleware = BodyLimitMiddleware(app, max_bytes=800, max_buffered_bytes=800, uncharged_bytes=100)  # type: ignore[arg-type]
        middleware.budget.held = 500  # type: ignore[union-attr]  # others' uploads
        chunked = _scope([(b"transfer-encoding", b"chunked")])
        with pytest.raises(BodyBudgetSpent):  # 100 uncharged, then 200 held, then 200 more: past
            await middleware(chunked, _chunks(b"x" * 100, b"x" * 200, b"x" * 200, b"x"), _noop_send)
        assert middleware.budget is not None and middleware.budget.held == 500
        await middleware(chunked, _chunks(b"x" * 300, b"x" * 100), _noop_send)  # 300 past 100: fits
        assert middleware.budget.held == 500

    asyncio.run(scenario())


def test_a_failed_request_gives_back_what_its_body_held() -> None:
    async def scenario() -> None:
        async def broken(scope: object, receive: Callable[[], Awaitable[Message]], send: object) -> None:
            await receive()
            raise RuntimeError("the handler fell over mid-body")

        middleware = BodyLimitMiddleware(broken, max_bytes=800, max_buffered_bytes=1000, uncharged_bytes=0)  # type: ignore[arg-type]
        chunked = _scope([(b"transfer-encoding", b"chunked")])
        with pytest.raises(RuntimeError):
            await middleware(chunked, _chunks(b"x" * 10, b"x" * 10), _noop_send)
        assert middleware.budget is not None and middleware.budget.held == 0

    asyncio.run(scenario())


def test_a_request_without_a_body_takes_nothing() -> None:
    async def scenario() -> None:
        async def app(scope: object, receive: Callable[[], Awaitable[Message]], send: object) -> None:
            await receive()

        middleware = BodyLimitMiddleware(app, max_bytes=800, max_buffered_bytes=800)  # type: ignore[arg-type]
        middleware.budget.held = 800  # type: ignore[union-attr]  # spent by others
        await middleware({**_scope([]), "method": "GET"}, _chunks(b""), _noop_send)

    asyncio.run(scenario())


def test_the_budget_cannot_be_under_the_size_limit() -> None:
    with pytest.raises(
        ConfigError, match=r"server\.max_buffered_body_bytes: 1000 is under server\.max_body_bytes"
    ):
        parse_serve_config({"server": {"max_body_bytes": 2000, "max_buffered_body_bytes": 1000}})
    assert parse_serve_config({}).server.max_buffered_body_bytes == 64 << 20
    # A size limit raised past the default budget, the budget unset: one body still fits.
    raised = parse_serve_config({"server": {"max_body_bytes": 100 << 20}})
    assert raised.server.max_buffered_body_bytes == 100 << 20


def test_a_negative_content_length_adds_no_room_to_the_budget() -> None:
    """One the HTTP layer let through once added room to the budget while its body was
    read; the body takes what arrives of it, as any other."""

    async def scenario() -> None:
        seen: list[int] = []

        async def app(scope: object, receive: Callable[[], Awaitable[Message]], send: object) -> None:
            await receive()  # the first part: more to come
            seen.append(middleware.budget.held)  # type: ignore[union-attr]
            await receive()

        middleware = BodyLimitMiddleware(app, max_bytes=800, max_buffered_bytes=800, uncharged_bytes=0)  # type: ignore[arg-type]
        await middleware(_scope([(b"content-length", b"-500")]), _chunks(b"x", b"x"), _noop_send)
        assert seen == [MESSAGE_COST] and middleware.budget is not None and middleware.budget.held == 0

    asyncio.run(scenario())


def test_a_body_sent_a_byte_at_a_time_counts_each_part_past_the_uncharged_64_kib() -> None:
    """The app keeps each part as a bytes object of about 40 bytes besides its own: a body
    sent a byte a segment grew the server 40 times its size, uncounted (a review)."""

    async def scenario() -> None:
        seen: list[int] = []

        async def app(scope: object, receive: Callable[[], Awaitable[Message]], send: object) -> None:
            message = await receive()
            while message.get("more_body"):
                seen.append(middleware.budget.held)  # type: ignore[union-attr]
                message = await receive()

        middleware = BodyLimitMiddleware(app, max_bytes=1 << 20, max_buffered_bytes=1 << 20)  # type: ignore[arg-type]
        parts = 2 * UNCHARGED_BYTES // MESSAGE_COST
        await middleware(_scope([(b"transfer-encoding", b"chunked")]), _chunks(*[b"x"] * parts), _noop_send)
        assert seen[UNCHARGED_BYTES // MESSAGE_COST - 1] == 0  # within the uncharged 64 KiB
        assert seen[-1] == (parts - 1) * MESSAGE_COST - UNCHARGED_BYTES
        assert middleware.budget is not None and middleware.budget.held == 0

    asyncio.run(scenario())
