"""The `/metrics` body, made at most once per `[server] metrics_max_age_s`.

/metrics needs no key, and each exposition costs work where it hurts: the engine process
collects and pickles its families between two steps, and the server merges and renders
them on the event loop that streams tokens (~5 and ~12 ms, 30 KB, on a busy 2-core host).
Made at every scrape, four clients looping on it (~50 scrapes a second) cut another
client's P0 stream from 110 to 33 chunks a second (an attack trial, 2026-12-07). A scrape
within the age of the last body gets that body; scrapes that come while one is being made
wait for it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable


class ExpositionCache:
    """`make` (the exposition) run at most once per `max_age_s` of `now` (seconds), and once
    for any number of scrapes waiting at the same time; 0 = made for every scrape that does
    not find one being made."""

    def __init__(
        self, make: Callable[[], Awaitable[bytes]], max_age_s: float, now: Callable[[], float]
    ) -> None:
        self._make = make
        self._max_age_s = max_age_s
        self._now = now
        self._body: bytes | None = None
        self._made_at = -math.inf
        self._making: asyncio.Future[bytes] | None = None

    async def get(self) -> bytes:
        if self._body is not None and self._now() - self._made_at < self._max_age_s:
            return self._body
        if self._making is None:
            self._making = asyncio.ensure_future(self._remake())
            # Read if every scrape waiting for it left first (no "exception never retrieved").
            self._making.add_done_callback(lambda f: f.cancelled() or f.exception())
        # Shielded: a scraper that leaves does not cancel the body the others wait for.
        return await asyncio.shield(self._making)

    async def _remake(self) -> bytes:
        try:
            body = await self._make()
        finally:
            self._making = None
        self._body, self._made_at = body, self._now()
        return body
