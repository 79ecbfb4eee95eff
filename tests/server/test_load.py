"""200 concurrent mixed-tier requests: every request ends once, the pool is whole, metrics add up."""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import MODEL, end_counts, live_server, make_state, pool_free_and_total
from tierserve.server.config import parse_serve_config
from tierserve.server.metrics import WAIT_BUCKETS

LOAD_CONFIG = {
    "limits": {"queue_cap": {"P3": 15}},
    "tenants": {"t": {"api_keys": ["sk-t"], "max_tier": "P0", "requests_per_s": 0.001, "request_burst": 170}},
}
NUM_REQUESTS = 200


@dataclass
class LoadResult:
    outcomes: Counter[str]
    num_prompt_tokens: int  # of requests that were served
    during: dict[str, dict[tuple[tuple[str, str], ...], float]]  # a scrape taken under load
    after: dict[str, dict[tuple[tuple[str, str], ...], float]]
    free_blocks: int
    total_blocks: int
    engine_ends: tuple[int, int, int]  # finished, aborted, rejected


def _parse(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def _one(client: openai.AsyncOpenAI, rng: random.Random, i: int) -> tuple[str, int]:
    tier = rng.choice(["P0", "P1", "P1", "P2", "P3"])
    kw = {
        "model": MODEL,
        "max_tokens": rng.randint(4, 48),
        "extra_headers": {"x-request-tier": tier},
    }
    prompt = "x" * rng.randint(10, 400)
    try:
        if rng.random() < 0.5:
            r = await client.completions.create(prompt=prompt, **kw)  # type: ignore[call-overload]
            assert r.usage is not None
            return f"done:{r.choices[0].finish_reason}", r.usage.prompt_tokens
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            messages=[{"role": "user", "content": prompt}],
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
        reason, num_prompt = None, 0
        async for chunk in stream:
            if i % 10 == 0:
                await stream.close()
                return "hung_up", 0
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                num_prompt = chunk.usage.prompt_tokens
        return f"done:{reason}", num_prompt
    except openai.APIStatusError as e:
        return f"refused:{e.status_code}", 0


@pytest.fixture(scope="module")
def load() -> Iterator[LoadResult]:
    state = make_state(
        parse_serve_config(LOAD_CONFIG),
        num_device_blocks=160,
        max_model_len=2048,
        swap_block_s=1e-6,
        step_s=0.02,  # steps long enough that a scrape (slow on a busy host) sees the load running
    )
    with live_server(state) as srv:
        scrapes: list[str] = []
        done = threading.Event()

        def scrape() -> None:
            # A thread of its own: on a busy host the clients' event loop can go seconds
            # between two of its own scrapes, after the load has come and gone.
            with httpx.Client(timeout=30) as http:
                while not done.is_set():
                    scrapes.append(http.get(srv.url + "/metrics").text)
                    done.wait(0.05)

        async def run() -> list[tuple[str, int]]:
            client = openai.AsyncOpenAI(base_url=srv.base_url, api_key="sk-t", max_retries=0, timeout=60)
            rng = random.Random(7)
            outcomes = await asyncio.gather(
                *(_one(client, random.Random(rng.random()), i) for i in range(NUM_REQUESTS))
            )
            await client.close()
            return list(outcomes)

        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            outcomes = asyncio.run(run())
        finally:
            done.set()
            scraper.join(timeout=60)
        # the scrape taken under load that saw the most running requests
        running = "vllm:num_requests_running"
        during = max(scrapes, key=lambda t: _parse(t)[running][(("model_name", MODEL),)])
        srv.wait_engine_idle(timeout_s=20)
        free, total = srv.inspect(pool_free_and_total)
        ends = srv.inspect(end_counts)
        after = httpx.get(srv.url + "/metrics").text
        yield LoadResult(
            Counter(o for o, _ in outcomes),
            sum(n for _, n in outcomes),
            _parse(during),
            _parse(after),
            free,
            total,
            ends,
        )


def test_mixed_tier_load_each_request_ends_once_and_the_pool_is_whole(load: LoadResult) -> None:
    counts = load.outcomes
    assert sum(counts.values()) == NUM_REQUESTS
    assert set(counts) <= {"done:length", "hung_up", "refused:429", "refused:503"}, counts
    assert counts["refused:429"] == NUM_REQUESTS - 170  # the tenant's burst
    assert counts["refused:503"] > 0 and counts["done:length"] > 100
    assert load.free_blocks == load.total_blocks
    finished, aborted, rejected = load.engine_ends
    engine_ends = counts["done:length"] + counts["hung_up"]
    assert finished + aborted == engine_ends and rejected == 0  # each one ended exactly once
    assert aborted <= counts["hung_up"]
    outcomes = load.after["tierserve_requests_total"]
    assert sum(outcomes.values()) == engine_ends


def _by(metric: dict[tuple[tuple[str, str], ...], float], label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in metric.items():
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


TIERS = {"P0", "P1", "P2", "P3"}


def test_metrics_expose_every_named_metric_with_sensible_values(load: LoadResult) -> None:
    m = load.after
    counts = load.outcomes
    served = counts["done:length"]
    for name in (
        "llm_scheduler_queue_depth",
        "llm_kv_cache_hit_rate",
        "tierserve_kv_blocks_used",
        "tierserve_kv_blocks_borrowed",
    ):
        assert set(_by(m[name], "priority")) == TIERS, name
    assert set(_by(m["llm_scheduler_queue_depth"], "priority").values()) == {0.0}
    assert all(0.0 <= v <= 1.0 for v in m["llm_kv_cache_hit_rate"].values())
    assert max(m["llm_kv_cache_hit_rate"].values()) > 0  # the prompts share a prefix
    # Wait histogram: the article's buckets, one observation per request that got a token.
    les = {dict(labels)["le"] for labels in m["llm_scheduler_wait_seconds_bucket"]}
    assert les == {str(b) for b in WAIT_BUCKETS} | {"+Inf"}
    waits = sum(m["llm_scheduler_wait_seconds_count"].values())
    assert served <= waits <= served + counts["hung_up"]
    assert m["vllm:time_to_first_token_seconds_count"][(("model_name", MODEL),)] == waits
    assert m["vllm:e2e_request_latency_seconds_count"][(("model_name", MODEL),)] == served + counts["hung_up"]
    assert m["vllm:inter_token_latency_seconds_count"][(("model_name", MODEL),)] > served
    # Preemptions happened (a small pool) and the two namings agree.
    preempted = sum(m["llm_preemption_total"].values())
    assert preempted > 0 and m["vllm:num_preemptions_total"][(("model_name", MODEL),)] == preempted
    assert {dict(k)["reason"] for k in m["llm_preemption_total"]} == {"swap", "recompute"}
    assert m["llm_kv_swap_seconds_count"][(("direction", "out"),)] > 0
    assert all(0.0 <= v <= 1.0 for v in m["llm_sla_attainment"].values()) and m["llm_sla_attainment"]
    rejections = _by(m["tierserve_rejections_total"], "reason")
    # The burst may also meet an admission estimate beyond P0's deadline: 503 either way.
    assert rejections["queue_full"] > 0
    assert rejections["queue_full"] + rejections.get("deadline", 0) == counts["refused:503"]
    assert sum(v for k, v in rejections.items() if k.startswith("rate_limit")) == counts["refused:429"]
    assert m["vllm:prompt_tokens_total"][(("model_name", MODEL),)] >= load.num_prompt_tokens > 0
    assert m["vllm:generation_tokens_total"][(("model_name", MODEL),)] >= served * 4
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert m[name][(("model_name", MODEL),)] == 0.0, name
    # Under load the state gauges moved.
    d = load.during
    assert sum(d["tierserve_kv_blocks_used"].values()) > 0
    assert 0.0 < d["vllm:kv_cache_usage_perc"][(("model_name", MODEL),)] <= 1.0
    assert d["vllm:num_requests_running"][(("model_name", MODEL),)] > 0
