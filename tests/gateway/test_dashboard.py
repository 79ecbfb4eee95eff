"""The dashboard's fleet row charts the gateway's metrics, and only metrics a gateway exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tierserve.gateway.config import parse_gateway_config
from tierserve.gateway.state import build_gateway_state
from tierserve.tiers import Tier

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"
REQUIRED = [
    "tierserve_gateway_queue_depth",
    "tierserve_gateway_queue_wait_seconds",
    "tierserve_gateway_upstream_saturated",
    "tierserve_gateway_upstream_requests",
    "tierserve_gateway_routing_decisions",
    "tierserve_gateway_retries",
    "tierserve_gateway_redis_errors",
]


def _fleet_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", []) if "tierserve_gateway_" in t["expr"]]


def _exported() -> set[str]:
    raw = {"upstreams": [{"name": "u", "kind": "vllm", "url": "http://127.0.0.1:1"}]}
    gw = build_gateway_state(parse_gateway_config(raw))
    m = gw.metrics
    m.queue_wait.labels("P0").observe(0.1)
    m.decisions.labels("affinity").inc()
    m.retries.labels("u").inc()
    m.upstream_requests.labels("u", "ok").inc()
    m.reject("queue_full", Tier.P1)
    return {family.name for family in text_string_to_metric_families(m.render().decode())}


def test_the_fleet_row_charts_every_gateway_metric_and_only_exported_ones() -> None:
    exprs = _fleet_exprs()
    text = "\n".join(exprs)
    for name in REQUIRED:
        assert name in text, name
    exported = _exported()
    for expr in exprs:
        for name in re.findall(r"\b(tierserve_gateway_[a-z_]+)\{", expr):
            base = re.sub(r"_(bucket|total)$", "", name)
            assert name in exported or base in exported, (name, expr)


def test_the_job_picker_lists_gateways_too() -> None:
    """The `job` variable listed the jobs exporting the server's queue depth only: a gateway's
    job was never offered, and its Fleet row showed data only under "All"."""
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    (job,) = [v for v in variables if v["name"] == "job"]
    query = job["query"]["query"]
    names = re.findall(r"[a-z_]+_queue_depth", query)
    assert "llm_scheduler_queue_depth" in names  # a server's
    assert [n for n in names if n in _exported()], query  # and one that every gateway exports
