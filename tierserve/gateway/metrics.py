"""Prometheus metrics of one gateway, in its own registry.

Events (routing decisions, retries, upstream outcomes, refusals, queue waits) are counted
as they happen; state (tier queue depth, upstream saturation and load, Redis) is read
from the router, the flow control and the limiter when Prometheus scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tierserve.gateway.flow import FlowControl
from tierserve.gateway.router import Router
from tierserve.server.metrics import http_errors_counter
from tierserve.server.ratelimit import RateLimiter
from tierserve.tiers import ALL_TIERS, Tier

WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
# Fine around the 2 ms target for the gateway's added latency (docs/gateway.md).
ADDED_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1, 1.0)


class _StateCollector(Collector):
    def __init__(self, router: Router, flow: FlowControl, limiter: Callable[[], RateLimiter]) -> None:
        self._router = router
        self._flow = flow
        self._limiter = limiter

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "tierserve_gateway_queue_depth", "Requests waiting in the gateway, by tier", labels=["priority"]
        )
        for tier in ALL_TIERS:
            depth.add_metric([tier.name], float(self._flow.depth(tier)))
        yield depth
        families = {
            "healthy": GaugeMetricFamily(
                "tierserve_gateway_upstream_healthy", "1 while admitted by health checks", labels=["upstream"]
            ),
            "saturated": GaugeMetricFamily(
                "tierserve_gateway_upstream_saturated",
                "1 while full for requests of the tier (work ahead of them or KV over its threshold, "
                "or metrics stale)",
                labels=["upstream", "priority"],
            ),
            "load": GaugeMetricFamily(
                "tierserve_gateway_upstream_load",
                "Running + waiting requests, as last seen",
                labels=["upstream"],
            ),
            "in_flight": GaugeMetricFamily(
                "tierserve_gateway_upstream_in_flight",
                "This gateway's requests in flight",
                labels=["upstream"],
            ),
        }
        router = self._router
        for s in router.states:
            families["healthy"].add_metric([s.name], 1.0 if s.healthy else 0.0)
            for tier in ALL_TIERS:
                full = router.saturated(s, tier)
                families["saturated"].add_metric([s.name, tier.name], 1.0 if full else 0.0)
            families["load"].add_metric([s.name], router.load(s))
            families["in_flight"].add_metric([s.name], float(s.num_in_flight))
        yield from families.values()
        limiter = self._limiter()
        if limiter.redis_up is not None:
            up = GaugeMetricFamily(
                "tierserve_ratelimit_redis_up", "1 while the Redis rate-limit backend answers"
            )
            up.add_metric([], 1.0 if limiter.redis_up else 0.0)
            yield up
        for name, doc, value in (
            (
                "tierserve_ratelimit_fallback",
                "Rate-limit decisions taken without Redis",
                limiter.num_fallbacks,
            ),
            ("tierserve_gateway_redis_errors", "Redis operations that failed", limiter.num_redis_errors),
        ):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(value))
            yield c


# The labels the gateway's series start with, at 0 (see `server.metrics.REJECTION_REASONS`).
REJECTION_REASONS = (
    "draining",
    "rate_limit_requests",
    "rate_limit_tokens",
    "rate_limit_too_large",
    "rate_limit_unavailable",
    "queue_full",
    "queue_timeout",
    "no_upstream",
    "client_left",
    "cut",
    "upstream_overloaded",
    "upstream_unavailable",
)
ROUTING_REASONS = ("affinity", "least_loaded", "p0_soonest")
# An upstream's outcomes but `http_<status>`, which only a reply names.
UPSTREAM_OUTCOMES = (
    "ok",
    "retried",
    "failed",
    "timeout",
    "broken",
    "client_left",
    "cut",
    "too_large",
    "error",
)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.queue_wait = Histogram(
            "tierserve_gateway_queue_wait_seconds",
            "Time a request waited in the gateway's tier queues",
            ["priority"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.added = Histogram(
            "tierserve_gateway_added_seconds",
            "The gateway's own share of a stream's time to first token: from the request's "
            "arrival to its upstream call, and from the upstream's first bytes to the client's",
            buckets=ADDED_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "tierserve_gateway_routing_decisions",
            "Requests sent to an upstream (at once or after waiting), by why that upstream",
            ["reason"],
            registry=r,
        )
        self.retries = Counter(
            "tierserve_gateway_retries",
            "Requests moved to another upstream (failed before the first byte)",
            ["upstream"],
            registry=r,
        )
        self.upstream_requests = Counter(
            "tierserve_gateway_upstream_requests",
            "Requests sent to each upstream, by how they ended",
            ["upstream", "outcome"],
            registry=r,
        )
        self.rejections = Counter(
            "tierserve_rejections",
            "Requests the gateway refused (sent to no upstream, or every attempt failed before "
            "the first byte) or that left its queue (client_left), by reason",
            ["reason", "priority"],
            registry=r,
        )
        self.http_errors = http_errors_counter(r)
        self.ejections = Counter(
            "tierserve_gateway_upstream_ejections",
            "Upstreams ejected, by health checks or by forwarded requests (unreachable or silent)",
            ["upstream"],
            registry=r,
        )
        self._start_at_zero()

    def _start_at_zero(self) -> None:
        """Each tier's waits and refusals, and each routing reason, exported at 0 from the
        start (each upstream's counts once the router is known: `bind`)."""
        for tier in ALL_TIERS:
            self.queue_wait.labels(tier.name)
            for reason in REJECTION_REASONS:
                self.rejections.labels(reason, tier.name)
        self.rejections.labels("draining", "none")  # refused before its tier was read
        for reason in ROUTING_REASONS:
            self.decisions.labels(reason)

    def bind(self, router: Router, flow: FlowControl, limiter: Callable[[], RateLimiter]) -> None:
        self.registry.register(_StateCollector(router, flow, limiter))
        for s in router.states:  # each upstream's counts start at 0 too
            self.retries.labels(s.name)
            self.ejections.labels(s.name)
            for outcome in UPSTREAM_OUTCOMES:
                self.upstream_requests.labels(s.name, outcome)

    def count_http_error(self, reason: str) -> None:
        self.http_errors.labels(reason).inc()

    def reject(self, reason: str, tier: Tier | None) -> None:
        self.rejections.labels(reason, tier.name if tier is not None else "none").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
