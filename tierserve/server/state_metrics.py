"""State metrics, read from the engine's latest snapshot when Prometheus scrapes.

The engine thread publishes an `EngineSnapshot` after every step; a scrape never touches
the engine. Cumulative engine counters (preemptions) are exported as counters from it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tierserve.engine import Engine
from tierserve.tiers import ALL_TIERS, Tier

PREEMPTION_REASONS = ("swap", "recompute")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state after a step, taken on the engine thread."""

    waiting: Mapping[Tier, int] = field(default_factory=dict)
    running: Mapping[Tier, int] = field(default_factory=dict)
    swapped: Mapping[Tier, int] = field(default_factory=dict)
    blocks_used: Mapping[Tier, int] = field(default_factory=dict)
    blocks_borrowed: Mapping[Tier, int] = field(default_factory=dict)
    prefix_hit_rate: Mapping[Tier, float] = field(default_factory=dict)
    preemptions: Mapping[tuple[Tier, str], int] = field(default_factory=dict)
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_steps: int = 0


@dataclass(frozen=True)
class LimiterState:
    redis_up: bool | None  # None: no Redis backend configured
    num_fallbacks: int


def snapshot_of(engine: Engine) -> EngineSnapshot:
    """Read the engine's state; call only on the engine thread, between steps."""
    mem = engine.memory
    return EngineSnapshot(
        waiting={t: engine.num_waiting(t) for t in ALL_TIERS},
        running={t: engine.num_running(t) for t in ALL_TIERS},
        swapped={t: engine.num_swapped(t) for t in ALL_TIERS},
        blocks_used={t: mem.used_blocks(t) for t in ALL_TIERS},
        blocks_borrowed={t: mem.borrowed_blocks(t) for t in ALL_TIERS},
        prefix_hit_rate={t: mem.prefix_hit_rate(t) for t in ALL_TIERS},
        preemptions=dict(engine.stats.preemptions),
        num_blocks=mem.num_blocks,
        num_free_blocks=mem.num_free_blocks,
        num_steps=engine.stats.num_steps,
    )


class StateCollector(Collector):
    """Yields the state metrics from whatever `snapshot`, `sla_counts` and `limiter` return at
    scrape time."""

    def __init__(
        self, model_name: str, sla_counts: Callable[[], Mapping[tuple[Tier, Tier], tuple[int, int]]]
    ) -> None:
        self._model = model_name
        self._sla_counts = sla_counts
        self.snapshot: Callable[[], EngineSnapshot] = EngineSnapshot
        self.limiter: Callable[[], LimiterState] | None = None

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.snapshot()
        yield from _tiers_and_blocks(s)
        yield from _sla(self._sla_counts())
        yield from _preemptions(s, [self._model])
        yield from _vllm_gauges(s, [self._model])
        if self.limiter is not None:
            yield from _limiter(self.limiter())


def _by_tier(name: str, doc: str, values: Mapping[Tier, float]) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["priority"])
    for t in ALL_TIERS:
        g.add_metric([t.name], float(values.get(t, 0)))
    return g


def _tiers_and_blocks(s: EngineSnapshot) -> Iterator[GaugeMetricFamily]:
    yield _by_tier("llm_scheduler_queue_depth", "Requests waiting to start, by tier", s.waiting)
    yield _by_tier(
        "llm_kv_cache_hit_rate", "Prefix-cache hit rate of prompt tokens, by tier", s.prefix_hit_rate
    )
    yield _by_tier("tierserve_kv_blocks_used", "KV blocks held, by tier", s.blocks_used)
    yield _by_tier(
        "tierserve_kv_blocks_borrowed", "KV blocks held beyond the tier's own share", s.blocks_borrowed
    )
    yield _by_tier("tierserve_requests_running", "Requests holding device blocks, by tier", s.running)
    yield _by_tier(
        "tierserve_requests_swapped", "Requests whose blocks are in host memory, by tier", s.swapped
    )
    total = GaugeMetricFamily("tierserve_kv_blocks_capacity", "KV blocks in the device pool")
    total.add_metric([], float(s.num_blocks))
    yield total
    free = GaugeMetricFamily("tierserve_kv_blocks_free", "Free KV blocks (cached ones included)")
    free.add_metric([], float(s.num_free_blocks))
    yield free


def _sla(
    counts: Mapping[tuple[Tier, Tier], tuple[int, int]],
) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Attainment since start-up, and the same as counts: attainment over a window (rate of
    met over rate of all) and summed over replicas."""
    # Each tier's own pair starts at 0 (a series born with its first miss escaped increase()).
    judged = sorted({**{(t, t): (0, 0) for t in ALL_TIERS}, **counts}.items())
    sla = GaugeMetricFamily(
        "llm_sla_attainment",
        "Fraction of started requests whose TTFT met the target "
        "of the tier they ran at (priority), by the tenant's entitled tier (tier)",
        labels=["priority", "tier"],
    )
    for (tier, entitled), (met, missed) in judged:
        if met + missed:
            sla.add_metric([tier.name, entitled.name], met / (met + missed))
    yield sla
    requests = CounterMetricFamily(
        "llm_sla_requests",
        "Requests judged against the TTFT target of the tier they ran at (priority), by the "
        "tenant's entitled tier (tier): met, or missed (a request that ended with no token "
        "after waiting past the target counts as missed)",
        labels=["priority", "tier", "outcome"],
    )
    for (tier, entitled), (met, missed) in judged:
        requests.add_metric([tier.name, entitled.name, "met"], float(met))
        requests.add_metric([tier.name, entitled.name, "missed"], float(missed))
    yield requests


def _preemptions(s: EngineSnapshot, model: list[str]) -> Iterator[CounterMetricFamily]:
    pre = CounterMetricFamily("llm_preemption", "Preempted requests", labels=["victim_priority", "reason"])
    counts = {(t, r): 0 for t in ALL_TIERS for r in PREEMPTION_REASONS}
    counts.update(s.preemptions)
    for (tier, reason), n in sorted(counts.items()):
        pre.add_metric([tier.name, reason], float(n))
    yield pre
    vpre = CounterMetricFamily("vllm:num_preemptions", "Preemptions", labels=["model_name"])
    vpre.add_metric(model, float(sum(s.preemptions.values())))
    yield vpre


def _vllm_gauges(s: EngineSnapshot, model: list[str]) -> Iterator[GaugeMetricFamily]:
    for name, doc, value in (
        ("vllm:num_requests_running", "Requests in the running batch", sum(s.running.values())),
        ("vllm:num_requests_waiting", "Requests waiting", sum(s.waiting.values())),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage, 1 = full",
            (1 - s.num_free_blocks / s.num_blocks) if s.num_blocks else 0.0,
        ),
    ):
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric(model, float(value))
        yield g


def _limiter(state: LimiterState) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    if state.redis_up is not None:
        up = GaugeMetricFamily("tierserve_ratelimit_redis_up", "1 while the Redis rate-limit backend answers")
        up.add_metric([], 1.0 if state.redis_up else 0.0)
        yield up
    fb = CounterMetricFamily(
        "tierserve_ratelimit_fallback",
        "Rate-limit decisions taken without Redis (on local buckets if fail-open, refused if fail-closed)",
    )
    fb.add_metric([], float(state.num_fallbacks))
    yield fb
