"""Per-tier metrics of the plug-in, under the names tierserve's own server exports
(`tierserve/server/metrics.py`, `state_metrics.py`), so one dashboard reads both.

The scheduler runs in vLLM's engine-core process while `/metrics` is served by the API
server process. vLLM's endpoint reads prometheus_client's multiprocess directory when
$PROMETHEUS_MULTIPROC_DIR is set; the metrics here are written there by the engine core
and so appear on vLLM's own endpoint. Without it they stay in `registry` (enough for an
offline `LLM` whose engine runs in-process).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tierserve.server.metrics import WAIT_BUCKETS
from tierserve.tiers import ALL_TIERS, Tier

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
GAUGE_MODE: Final = "livesum"  # data-parallel engines each hold part of the queue and the blocks


def on_vllm_endpoint() -> bool:
    """Whether these metrics reach vLLM's `/metrics` (prometheus multiprocess mode is on)."""
    return bool(os.environ.get(MULTIPROC_ENV))


class TierMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.queue_depth = Gauge(
            "llm_scheduler_queue_depth",
            "Requests waiting to start, by tier",
            ["priority"],
            registry=r,
            multiprocess_mode=GAUGE_MODE,
        )
        self.blocks_used = Gauge(
            "tierserve_kv_blocks_used",
            "KV blocks held, by tier",
            ["priority"],
            registry=r,
            multiprocess_mode=GAUGE_MODE,
        )
        self.blocks_borrowed = Gauge(
            "tierserve_kv_blocks_borrowed",
            "KV blocks held beyond the tier's own share",
            ["priority"],
            registry=r,
            multiprocess_mode=GAUGE_MODE,
        )
        self.wait = Histogram(
            "llm_scheduler_wait_seconds",
            "Time from enqueue to first token, by tier",
            ["priority"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            "llm_preemption", "Preempted requests", ["victim_priority", "reason"], registry=r
        )
        for t in ALL_TIERS:  # every series exists from the start, at zero
            self.wait.labels(t.name)
            self.preemptions.labels(t.name, "recompute")
            self.preemptions.labels(t.name, "swap")
        # The state gauges, one per tier, looked up once; set on every step, so each is
        # written only when its value changed (in multiprocess mode a write is a file's).
        self._state = [
            [g.labels(t.name) for t in ALL_TIERS]
            for g in (self.queue_depth, self.blocks_used, self.blocks_borrowed)
        ]
        self._published: list[list[float]] = [[0.0] * len(ALL_TIERS) for _ in self._state]

    def publish_state(self, waiting: Sequence[int], used: Sequence[int], borrowed: Sequence[int]) -> None:
        for gauges, last, values in zip(self._state, self._published, (waiting, used, borrowed), strict=True):
            for t, value in enumerate(values):
                if value != last[t]:
                    gauges[t].set(value)
                    last[t] = value

    def observe_first_token(self, tier: Tier, wait_s: float) -> None:
        self.wait.labels(tier.name).observe(max(0.0, wait_s))

    def preempted(self, tier: Tier, reason: str) -> None:
        self.preemptions.labels(tier.name, reason).inc()
