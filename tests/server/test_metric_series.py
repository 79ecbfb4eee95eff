"""Every labelled series a dashboard or an alert names is exported at 0 from the start.

A series that appears only with its first event is missed by `rate()` and `increase()`
(there is no earlier sample to compare with), so an alert on a tier's first refusal, an
upstream's first ejection or a tier's first SLA miss never fired.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tierserve.gateway import metrics as gateway_metrics
from tierserve.gateway.config import parse_gateway_config
from tierserve.gateway.state import build_gateway_state
from tierserve.server import metrics as server_metrics
from tierserve.server.metrics import ServerMetrics
from tierserve.tiers import ALL_TIERS

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _at_zero(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> bool:
    return samples.get((name, frozenset(labels.items()))) == 0.0


def _doc_row(path: Path, metric: str) -> str:
    rows = [line for line in path.read_text().splitlines() if line.startswith(f"| `{metric}`")]
    assert len(rows) == 1, f"{path.name}: {len(rows)} rows for {metric}"
    return rows[0]


def test_a_fresh_server_exports_each_tiers_refusals_outcomes_waits_and_sla_counts_at_zero() -> None:
    metrics = ServerMetrics("m", {t: 1.0 for t in ALL_TIERS})
    samples = _samples(metrics.render().decode())
    for tier in (t.name for t in ALL_TIERS):
        for reason in server_metrics.REJECTION_REASONS:
            assert _at_zero(samples, "tierserve_rejections_total", reason=reason, priority=tier)
        for reason in server_metrics.FINISH_REASONS:
            assert _at_zero(samples, "tierserve_requests_total", priority=tier, finish_reason=reason)
        assert _at_zero(samples, "llm_scheduler_wait_seconds_count", priority=tier)
        for outcome in ("met", "missed"):
            assert _at_zero(samples, "llm_sla_requests_total", priority=tier, tier=tier, outcome=outcome)
    assert _at_zero(samples, "tierserve_rejections_total", reason="draining", priority="none")
    for reason in server_metrics.HTTP_ERROR_REASONS:
        assert _at_zero(samples, "tierserve_http_errors_total", reason=reason)
    # No attainment is made up for a tier nothing was judged in.
    assert not any(name == "llm_sla_attainment" for name, _ in samples)


def test_the_servers_reasons_are_the_ones_its_docs_list() -> None:
    row = _doc_row(DOCS / "serving.md", "tierserve_rejections_total")
    assert re.findall(r"`(\w+)`", row.split("|")[4]) == list(server_metrics.REJECTION_REASONS)
    row = _doc_row(DOCS / "serving.md", "tierserve_http_errors_total")
    assert set(re.findall(r"`(\w+)`", row.split("|")[4])) == set(server_metrics.HTTP_ERROR_REASONS)
    row = _doc_row(DOCS / "serving.md", "tierserve_requests_total")
    assert re.findall(r"`(\w+)`", row.split("(")[0].split("|")[4]) == list(server_metrics.FINISH_REASONS)


def test_a_fresh_gateway_exports_each_tiers_refusals_and_each_upstreams_counts_at_zero() -> None:
    raw = {
        "upstreams": [
            {"name": "a", "kind": "vllm", "url": "http://127.0.0.1:1"},
            {"name": "b", "kind": "tierserve", "url": "http://127.0.0.1:2"},
        ]
    }
    samples = _samples(build_gateway_state(parse_gateway_config(raw)).metrics.render().decode())
    for tier in (t.name for t in ALL_TIERS):
        for reason in gateway_metrics.REJECTION_REASONS:
            assert _at_zero(samples, "tierserve_rejections_total", reason=reason, priority=tier)
        assert _at_zero(samples, "tierserve_gateway_queue_wait_seconds_count", priority=tier)
    for upstream in ("a", "b"):
        assert _at_zero(samples, "tierserve_gateway_retries_total", upstream=upstream)
        assert _at_zero(samples, "tierserve_gateway_upstream_ejections_total", upstream=upstream)
        for outcome in gateway_metrics.UPSTREAM_OUTCOMES:
            assert _at_zero(
                samples, "tierserve_gateway_upstream_requests_total", upstream=upstream, outcome=outcome
            )
    for reason in gateway_metrics.ROUTING_REASONS:
        assert _at_zero(samples, "tierserve_gateway_routing_decisions_total", reason=reason)
    assert _at_zero(samples, "tierserve_rejections_total", reason="draining", priority="none")
    for reason in server_metrics.HTTP_ERROR_REASONS:
        assert _at_zero(samples, "tierserve_http_errors_total", reason=reason)


def test_the_gateways_reasons_and_outcomes_are_the_ones_its_docs_name() -> None:
    rejections = _doc_row(DOCS / "gateway.md", "tierserve_rejections_total{reason,priority}")
    for reason in gateway_metrics.REJECTION_REASONS:
        assert re.search(rf"\b{reason}\b", rejections), reason
    outcomes = _doc_row(DOCS / "gateway.md", "tierserve_gateway_upstream_requests_total{upstream,outcome}")
    for outcome in gateway_metrics.UPSTREAM_OUTCOMES:  # each named as an item of the list
        assert re.search(rf"(: |, ){outcome}( \(|,)", outcomes), outcome
    decisions = _doc_row(DOCS / "gateway.md", "tierserve_gateway_routing_decisions_total{reason}")
    for reason in gateway_metrics.ROUTING_REASONS:
        assert re.search(rf"\b{reason}\b", decisions), reason
