"""/metrics needs no key: its exposition is made at most once per `metrics_max_age_s`, so
scrapes in a loop cannot make the engine process (or the server's event loop) do work at
their pace."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.helpers import live_server, make_state
from tierserve.clock import VirtualClock
from tierserve.server.config import ServeConfig, ServerSettings
from tierserve.server.metrics_cache import ExpositionCache


class _Maker:
    """An exposition that says how many times it was made; `gate`, when set, holds each."""

    def __init__(self) -> None:
        self.num_made = 0
        self.gate: asyncio.Event | None = None
        self.fail = False

    async def __call__(self) -> bytes:
        self.num_made += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("no exposition")
        return b"made %d" % self.num_made


def test_a_scrape_within_the_age_gets_the_last_body_and_a_later_one_a_new_one() -> None:
    clock, make = VirtualClock(), _Maker()
    cache = ExpositionCache(make, 1.0, clock.now)

    async def scrapes() -> list[bytes]:
        got = [await cache.get() for _ in range(20)]
        clock.elapse(0.99)
        got.append(await cache.get())
        clock.elapse(0.01)
        got.append(await cache.get())
        return got

    got = asyncio.run(scrapes())
    assert got == [b"made 1"] * 21 + [b"made 2"] and make.num_made == 2


def test_scrapes_at_the_same_time_share_one_exposition_and_one_that_leaves_does_not_cancel_it() -> None:
    make = _Maker()
    cache = ExpositionCache(make, 0.0, VirtualClock().now)

    async def scrapes() -> list[bytes]:
        make.gate = asyncio.Event()
        leaving = asyncio.ensure_future(cache.get())
        waiting = [asyncio.ensure_future(cache.get()) for _ in range(9)]
        await asyncio.sleep(0)
        leaving.cancel()
        make.gate.set()
        return list(await asyncio.gather(*waiting))

    assert asyncio.run(scrapes()) == [b"made 1"] * 9 and make.num_made == 1


def test_a_failed_exposition_is_not_kept() -> None:
    make = _Maker()
    cache = ExpositionCache(make, 60.0, VirtualClock().now)
    make.fail = True
    with pytest.raises(RuntimeError):
        asyncio.run(cache.get())
    make.fail = False
    assert asyncio.run(cache.get()) == b"made 2"


def test_scrapes_in_a_loop_ask_the_engine_once_per_age() -> None:
    """Each scrape asked the engine process for its families between two steps: 4 clients
    looping on /metrics cut another client's P0 stream from 110 to 33 chunks/s."""
    state = make_state(ServeConfig(server=ServerSettings(metrics_max_age_s=60.0)), fresh_metrics=False)
    asked = []
    families = state.engine.metric_families

    async def counted() -> object:
        asked.append(1)
        return await families()

    state.engine.metric_families = counted  # type: ignore[method-assign]
    with live_server(state) as srv, ThreadPoolExecutor(4) as pool:
        bodies = list(pool.map(lambda _: httpx.get(srv.url + "/metrics", timeout=30).text, range(40)))
    assert len(asked) == 1
    assert len(set(bodies)) == 1 and "vllm:num_requests_running" in bodies[0]
