"""The relay after `data: [DONE]`: the stream is whole, whatever the upstream does next."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from unittest.mock import MagicMock

import aiohttp
import pytest

from tierserve.gateway.relay import Relay
from tierserve.gateway.usage import SseUsageTap

EVENT = b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'


@pytest.mark.parametrize("failure", [aiohttp.ClientPayloadError("payload not completed"), TimeoutError()])
def test_a_break_after_a_done_without_its_blank_line_ends_the_stream_whole(failure: BaseException) -> None:
    """The client got [DONE], then an upstream_failed event and [DONE] again, and the stream
    was counted broken."""

    async def chunks() -> AsyncIterator[bytes]:
        yield EVENT
        yield b"data: [DONE]"  # its blank line never comes
        raise failure

    async def relayed() -> tuple[bytes, MagicMock]:
        gw = MagicMock(relays=set(), num_in_flight=1)
        tap, it = SseUsageTap(False), chunks()
        first = tap.feed(await anext(it))
        relay = Relay(gw, MagicMock(upstream="f0"), None, MagicMock(), it, tap, first_bytes=(0.0, 0.0))
        return b"".join([c async for c in relay.run(first)]), gw

    out, gw = asyncio.run(relayed())
    assert out == EVENT + b"data: [DONE]\n\n"
    gw.metrics.upstream_requests.labels.assert_called_once_with("f0", "ok")


def test_nothing_after_done_reaches_the_client() -> None:
    tap = SseUsageTap(False)
    assert tap.feed(EVENT + b"data: [DONE]\n\n" + EVENT) == EVENT + b"data: [DONE]\n\n"
    assert tap.feed(EVENT) == b"" and tap.done
