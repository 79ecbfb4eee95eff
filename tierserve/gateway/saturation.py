"""An upstream's load, read from its Prometheus metrics.

vLLM and `tierserve serve` export `vllm:num_requests_waiting`, `vllm:num_requests_running`
and `vllm:kv_cache_usage_perc` (0..1); SGLang exports `sglang:num_queue_reqs`,
`sglang:num_running_reqs` and `sglang:token_usage`. Series with labels (one per model)
are summed; KV usage takes the largest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# kind -> (waiting, running, kv usage) metric names
METRIC_NAMES: dict[str, tuple[str, str, str]] = {
    "vllm": ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"),
    "tierserve": ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"),
    "sglang": ("sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage"),
}


class MetricsParseError(ValueError):
    """The scrape holds none of the series this kind of upstream exports."""


@dataclass(frozen=True, slots=True)
class LoadSample:
    num_waiting: float
    num_running: float
    kv_usage: float  # 0..1
    at: float  # clock time of the scrape


def _series(text: str, name: str) -> list[float]:
    values: list[float] = []
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        rest = line[len(name) :]
        if rest[:1] not in ("{", " "):
            continue  # a longer name sharing the prefix
        value = rest.rsplit("}", 1)[-1].split()
        if not value:
            continue
        try:
            number = float(value[0])
        except ValueError:
            continue
        if math.isfinite(number):
            values.append(number)
    return values


def parse_load(kind: str, text: str, at: float) -> LoadSample:
    """Raises `MetricsParseError` when the waiting and running series are both absent."""
    names = METRIC_NAMES.get(kind)
    if names is None:
        raise MetricsParseError(f"upstreams of kind {kind!r} export no load metrics")
    waiting, running, kv = (_series(text, n) for n in names)
    if not waiting and not running:
        raise MetricsParseError(f"none of {names[0]}, {names[1]} in the scrape")
    return LoadSample(sum(waiting), sum(running), max(kv, default=0.0), at)
