"""The shipped Grafana dashboard charts the metrics the server exports, and only those."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.helpers import live_server, make_state
from tierserve.server.config import parse_serve_config

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
REQUIRED = [
    "llm_scheduler_queue_depth",
    "llm_scheduler_wait_seconds",
    "llm_kv_cache_hit_rate",
    "llm_preemption",
    "llm_sla_requests",
    "llm_kv_swap_seconds",
    "tierserve_kv_blocks_used",
    "tierserve_kv_blocks_borrowed",
    "tierserve_rejections",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
]


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def _families() -> dict[str, str]:
    """Each family /metrics exports, with its type."""
    config = parse_serve_config(
        {"server": {"ratelimit": {"backend": "redis", "redis_url": "redis://127.0.0.1:1"}}}
    )
    state = make_state(config)
    state.metrics.reject("queue_full", None)  # labelled families appear once they have a sample
    with live_server(state) as srv:
        text = httpx.get(srv.url + "/metrics", timeout=30).text  # the engine process's families too
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def _exported() -> set[str]:
    return set(_families())


def test_only_counters_end_in_total() -> None:
    # Prometheus keeps `_total` for counters; a gauge so named reads as one in PromQL and lint.
    misnamed = [name for name, kind in _families().items() if kind != "counter" and name.endswith("_total")]
    assert misnamed == []


def test_dashboard_charts_every_named_metric() -> None:
    text = "\n".join(_exprs())
    for name in REQUIRED:
        assert name in text, name


def test_dashboard_queries_only_exported_metrics() -> None:
    exported = _exported()
    for expr in _exprs():
        for name in re.findall(r"\b((?:llm|tierserve|vllm:)[a-z_:]+)\{", expr):
            if name.startswith("tierserve_gateway_"):
                continue  # the fleet row: the gateway's metrics (tests/gateway/test_dashboard.py)
            base = re.sub(r"_(bucket|total)$", "", name)
            assert name in exported or base in exported, (name, expr)
