"""An upstream's load, read from its Prometheus metrics.

vLLM and `tierserve serve` export `vllm:num_requests_waiting`, `vllm:num_requests_running`
and `vllm:kv_cache_usage_perc` (0..1); SGLang exports `sglang:num_queue_reqs`,
`sglang:num_running_reqs` and `sglang:token_usage`. Series with labels (one per model)
are summed; KV usage takes the largest.

tierserve and tierserve's vLLM plug-in also export the waiting queue by tier,
`llm_scheduler_queue_depth{priority="P0".."P3"}`: when it is there the sample keeps it,
so the router can count only the work an upstream will run ahead of a request's tier.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from tierserve.tiers import ALL_TIERS, Tier

# kind -> (waiting, running, kv usage) metric names
METRIC_NAMES: dict[str, tuple[str, str, str]] = {
    "vllm": ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"),
    "tierserve": ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"),
    "sglang": ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"),
}


TIER_DEPTH_METRIC = "llm_scheduler_queue_depth"  # waiting requests, by `priority` label
TIER_DEPTH_KINDS = ("vllm", "tierserve")  # kinds that may export it (vLLM: with tierserve's plug-in)
_PRIORITY_LABEL = re.compile(r'priority="([^"]*)"')


class MetricsParseError(ValueError):
    """The scrape holds none of the series this kind of upstream exports."""


class NotExposition(ValueError):
    """The scrape is not Prometheus exposition text: an HTML page from a proxy, say."""


@dataclass(frozen=True, slots=True)
class LoadSample:
    num_waiting: float
    num_running: float
    kv_usage: float  # 0..1
    at: float  # clock time of the scrape
    waiting_by_tier: tuple[float, ...] | None = None  # P0..P3, when the upstream exports it


def _samples(text: str, name: str) -> Iterator[tuple[str, float]]:
    """(label text, value) of each finite sample of the series `name`."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " "):
            continue  # a longer name sharing the prefix
        labels, _, value = rest.rpartition("}")
        fields = value.split()
        if not fields:
            continue
        try:
            number = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(number):
            yield labels, number


def metric_values(text: str, name: str) -> list[float]:
    """The finite values of every sample of the series `name` in Prometheus text `text`."""
    return [value for _, value in _samples(text, name)]


def _by_tier(text: str, name: str) -> tuple[float, ...] | None:
    """The series summed per `priority` label (P0..P3), or None when it is absent."""
    totals = [0.0] * len(ALL_TIERS)
    found = False
    for labels, value in _samples(text, name):
        match = _PRIORITY_LABEL.search(labels)
        if match is None or match.group(1) not in Tier.__members__:
            continue
        totals[Tier[match.group(1)]] += value
        found = True
    return tuple(totals) if found else None


def check_exposition(text: str, content_type: str | None) -> None:
    """Raises `NotExposition` for a scrape served as HTML, or whose text does not parse as
    Prometheus exposition. For scrapes where `parse_load` found no load series: a fresh
    vLLM's valid text lacks them (it is idle), a proxy's page is a failed health check.
    The scrapes that hold the series (most) are not parsed a second time."""
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type in ("text/html", "application/xhtml+xml"):
        raise NotExposition(f"/metrics answered {media_type}, not Prometheus text")
    try:
        for _ in text_string_to_metric_families(text):
            pass
    except ValueError as e:
        raise NotExposition(f"/metrics is not Prometheus text ({str(e)[:80] or 'unparsable'})") from None


def parse_load(kind: str, text: str, at: float) -> LoadSample:
    """Raises `MetricsParseError` when the waiting and running series are both absent."""
    names = METRIC_NAMES.get(kind)
    if names is None:
        raise MetricsParseError(f"upstreams of kind {kind!r} export no load metrics")
    waiting, running, kv = (metric_values(text, n) for n in names)
    if not waiting and not running:
        raise MetricsParseError(f"none of {names[0]}, {names[1]} in the scrape")
    by_tier = _by_tier(text, TIER_DEPTH_METRIC) if kind in TIER_DEPTH_KINDS else None
    return LoadSample(sum(waiting), sum(running), max(kv, default=0.0), at, by_tier)
