"""The gateway's health checks and scrapes against upstreams answering over a mock transport."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx
import pytest

from tierserve.gateway.config import parse_gateway_config
from tierserve.gateway.poller import UpstreamPoller
from tierserve.gateway.router import UpstreamState
from tierserve.gateway.saturation import parse_load
from tierserve.gateway.state import build_gateway_state

MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}


Answer = Callable[[httpx.Request], httpx.Response]


def _polled(answer: Answer, kind: str = "vllm", rounds: int = 3) -> UpstreamState:
    """Upstream `u` as the gateway sees it after `rounds` polls answered by `answer`."""
    raw = {"upstreams": [{"name": "u", "kind": kind, "url": "http://127.0.0.1:1"}]}
    gw = build_gateway_state(parse_gateway_config(raw))

    async def run() -> None:
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        try:
            poller = UpstreamPoller(gw)
            for _ in range(rounds):
                await poller.poll_once()
        finally:
            await gw.client.aclose()

    asyncio.run(run())
    return gw.router.states[0]


def _poll(metrics_text: str) -> bool:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics_text)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        return httpx.Response(404)

    state = _polled(answer)
    return state.healthy and state.models == frozenset({"tiny"})


def test_a_fresh_vllm_that_has_not_reported_load_yet_is_admitted_as_idle() -> None:
    # vLLM with PROMETHEUS_MULTIPROC_DIR exports its load gauges only after its first request.
    assert _poll('vllm:num_preemptions_total{engine="0",model_name="tiny"} 0.0\n')


def test_an_upstream_reporting_its_load_is_admitted() -> None:
    assert _poll('vllm:num_requests_waiting{model_name="tiny"} 0.0\nvllm:num_requests_running 1.0\n')


def test_an_upstream_whose_models_fail_is_not_admitted() -> None:
    assert not _polled(lambda request: httpx.Response(500), rounds=1).healthy


def test_the_waiting_queue_by_tier_is_read_where_the_upstream_exports_it() -> None:
    text = (
        'vllm:num_requests_waiting{model_name="m"} 7\n'
        'vllm:num_requests_running{model_name="m"} 3\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
        'llm_scheduler_queue_depth{priority="P0"} 1\n'
        'llm_scheduler_queue_depth{priority="P2"} 2\n'
        'llm_scheduler_queue_depth{engine="1",priority="P2"} 4\n'
    )
    sample = parse_load("tierserve", text, 5.0)
    assert sample.waiting_by_tier == (1.0, 0.0, 6.0, 0.0)
    assert (sample.num_waiting, sample.num_running, sample.kv_usage) == (7.0, 3.0, 0.5)
    assert parse_load("vllm", text.split("llm_scheduler")[0], 5.0).waiting_by_tier is None


def test_an_upstream_never_admitted_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    """An upstream that fails its first checks (wrong URL, a key it wants) was never named in
    the log: the gateway answered 503 no_upstream without a reason anywhere."""

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, json={"error": "missing API key"})

    caplog.set_level(logging.WARNING, logger="tierserve.gateway")
    _polled(answer, kind="openai")
    said = [r.getMessage() for r in caplog.records if "not admitted" in r.getMessage()]
    assert len(said) == 1 and "upstream u (http://127.0.0.1:1) not admitted" in said[0] and "401" in said[0]


def test_an_ejection_is_said_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """httpx's status errors add a second line ("For more information check: <mozilla URL>"),
    which reached the log as a line of its own under each WARNING."""
    polls: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        polls.append(1)
        if len(polls) > 1:  # admitted on the first poll, then /metrics is gone
            return httpx.Response(404, text="Not Found")
        return httpx.Response(200, text='vllm:num_requests_running{model_name="tiny"} 1.0\n')

    caplog.set_level(logging.WARNING, logger="tierserve.gateway")
    assert not _polled(answer, rounds=3).healthy
    said = [r.getMessage() for r in caplog.records if "ejected" in r.getMessage()]
    assert len(said) == 1 and "404" in said[0] and "\n" not in said[0], said


def test_a_draining_tierserve_upstream_is_ejected_at_once() -> None:
    """Its /metrics still answers while it drains, so the gateway kept sending it requests,
    each refused with a 503 and retried elsewhere. Admitted on two good polls, it starts to
    drain before the third: one failed check ejects it (not `eject_after_failures`)."""
    readies: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text='vllm:num_requests_running{model_name="tiny"} 1.0\n')
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        if request.url.path == "/ready":
            readies.append(1)
            if len(readies) > 2:
                return httpx.Response(503, json={"status": "not ready", "reason": "draining"})
            return httpx.Response(200, json={"status": "ready"})
        return httpx.Response(404)

    assert _polled(answer, kind="tierserve", rounds=2).healthy
    readies.clear()
    state = _polled(answer, kind="tierserve", rounds=3)
    assert len(readies) == 3 and not state.healthy


@pytest.mark.parametrize(
    ("content_type", "page"),
    [
        ("text/html; charset=utf-8", "<!DOCTYPE html>\n<html><body>Sign in</body></html>\n"),
        ("text/plain", "<html><body>Sign in</body></html>\n"),  # a proxy that says text/plain
        ("text/plain", "upstream connect error or disconnect/reset before headers\n"),
    ],
)
def test_a_metrics_page_that_is_not_prometheus_text_ejects_the_upstream(
    content_type: str, page: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A 200 that is not metrics (a proxy's page) was taken for a fresh vLLM that has not
    reported load yet, and the upstream was admitted as idle for as long as it answered so.
    Admitted on its first poll, it then answers such a page: ejected, with its reason."""
    polls: list[int] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        polls.append(1)
        if len(polls) > 1:
            return httpx.Response(200, content=page.encode(), headers={"content-type": content_type})
        return httpx.Response(200, text='vllm:num_requests_running{model_name="tiny"} 1.0\n')

    caplog.set_level(logging.WARNING, logger="tierserve.gateway")
    assert not _polled(answer, rounds=4).healthy
    said = [r.getMessage() for r in caplog.records if "ejected" in r.getMessage()]
    assert len(said) == 1 and "not Prometheus text" in said[0], said


def test_a_metrics_page_that_is_not_prometheus_text_is_never_admitted() -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        return httpx.Response(
            200, text="<html><body>Sign in</body></html>", headers={"content-type": "text/html"}
        )

    assert not _polled(answer).healthy


def test_an_upstream_that_never_answers_its_check_holds_up_no_other_upstreams_scrape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`/metrics` trickling in a byte at a time never tripped httpx's per-read timeouts, and
    every upstream's scrape waited for the round: the healthy one's sample went stale, it
    counted as full, and requests queued in the gateway past their tier's max_wait_s."""
    raw = {
        "gateway": {"scrape_interval_s": 0.05, "stale_after_s": 0.3, "connect_timeout_s": 0.2},
        "upstreams": [
            {"name": "slow", "kind": "vllm", "url": "http://slow.test"},
            {"name": "ok", "kind": "vllm", "url": "http://ok.test"},
        ],
    }
    gw = build_gateway_state(parse_gateway_config(raw))
    metrics = 'vllm:num_requests_waiting{model_name="tiny"} 0.0\nvllm:num_requests_running 0.0\n'

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.host == "slow.test":
            await asyncio.sleep(3600)  # a trickle, as far as any one read's timeout can tell
        if request.url.path == "/metrics":
            return httpx.Response(200, text=metrics)
        return httpx.Response(200, json=MODELS)

    async def run() -> tuple[float, float]:
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        try:
            poller = UpstreamPoller(gw)
            started = gw.clock.now()
            await poller.poll_once()  # as the gateway does before it serves
            first_round = gw.clock.now() - started
            task = asyncio.get_running_loop().create_task(poller.run())
            await asyncio.sleep(1.0)
            ok = gw.router.states[1]
            assert ok.sample is not None
            age = gw.clock.now() - ok.sample.at
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return first_round, age
        finally:
            await gw.client.aclose()

    with caplog.at_level(logging.WARNING, logger="tierserve.gateway"):
        first_round, age = asyncio.run(run())
    slow, ok = gw.router.states
    assert first_round < 1.0  # the check's own deadline, not the trickle's
    assert ok.healthy and age < 0.3  # still fresh: not taken for a full replica
    assert not slow.healthy
    assert any("health check took over 0.2 s" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "models",
    [{"object": "list", "data": None}, [{"id": "tiny"}], {"object": "list"}],
)
def test_a_model_list_of_the_wrong_shape_fails_the_check_and_checks_go_on(models: object) -> None:
    """`{"data": null}` raised a TypeError that ended the upstream's check loop for good, in
    silence: it kept its last health state forever."""
    raw = {
        "gateway": {"scrape_interval_s": 0.05},
        "upstreams": [{"name": "u", "kind": "openai", "url": "http://u.test"}],
    }
    gw = build_gateway_state(parse_gateway_config(raw))
    asked = 0

    def answer(request: httpx.Request) -> httpx.Response:
        nonlocal asked
        asked += 1
        return httpx.Response(200, json=models)

    async def run() -> None:
        gw.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        try:
            poller = UpstreamPoller(gw)
            await poller.poll_once()
            task = asyncio.get_running_loop().create_task(poller.run())
            await asyncio.sleep(0.6)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            await gw.client.aclose()

    asyncio.run(run())
    assert not gw.router.states[0].healthy
    assert asked >= 6  # about one check an interval, not one and then none
