"""Prometheus metrics of one server, in its own `CollectorRegistry` (no global state).

Event metrics (histograms, counters of things that happen) are observed as they happen,
from the engine thread or a handler; prometheus_client's metrics are thread-safe.
State metrics (queue depth, KV blocks, cumulative engine counters) are read from the
latest engine snapshot when Prometheus scrapes. Names: the source article's `llm_*`
(docs/design.md §6), vLLM's `vllm:*` where they overlap (so vLLM dashboards keep working)
and `tierserve_*` for the rest.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, Metric, generate_latest

from tierserve.request import FinishReason
from tierserve.server.state_metrics import EngineSnapshot, LimiterState, StateCollector
from tierserve.tiers import ALL_TIERS, Tier

# Fine around the default targets (P0 0.5 s, P1 5 s) and the ones a deployment sets near
# them: with nothing between 0.1 and 0.5 s a P95 near P0's target was a guess across the gap.
WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 30.0, 60.0)
# fmt: off
# vLLM's buckets for the same names.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
# fmt: on
SWAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# Every reason `tierserve_http_errors_total` counts, server and gateway alike.
HTTP_ERROR_REASONS = (
    "header_too_large",
    "too_many_headers",
    "header_timeout",
    "body_timeout",
    "connection_limit",
    "evicted",
    "pipeline_limit",
    "aborted_upload",
    "send_timeout",
    "malformed_http",
    "unsupported_transfer_encoding",
    "invalid_api_key",
    "bad_header",
    "unsupported_content_type",
    "unsupported_content_encoding",
    "request_too_large",
    "busy",
    "busy_tenant",
    "not_found",
    "method_not_allowed",
)


def http_errors_counter(registry: CollectorRegistry) -> Counter:
    """`tierserve_http_errors_total{reason}`, as the server and the gateway both count it,
    every reason at 0 from the start."""
    counter = Counter(
        "tierserve_http_errors",
        "Requests ended at the HTTP layer before the application answered (limits, timeouts, "
        "uploads the client aborted), by reason",
        ["reason"],
        registry=registry,
    )
    for reason in HTTP_ERROR_REASONS:
        counter.labels(reason)
    return counter


# The labels each tier's series start with, at 0: a series that appears only with its first
# event is missed by rate() and increase(), so an alert on a tier's first refusal never fired.
REJECTION_REASONS = (
    "queue_full",
    "deadline",
    "draining",
    "rate_limit_requests",
    "rate_limit_tokens",
    "rate_limit_too_large",
    "rate_limit_unavailable",
    "engine_refused",
)
# How a request that reached the engine ends (one refused there is `engine_refused` above).
FINISH_REASONS = tuple(r.value for r in FinishReason if r is not FinishReason.REJECTED)


class ServerMetrics:
    def __init__(self, model_name: str, ttft_targets: Mapping[Tier, float]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._model = model_name
        self._targets = dict(ttft_targets)
        r = self.registry
        self.wait = Histogram(
            "llm_scheduler_wait_seconds",
            "Time from enqueue to first token, by tier",
            ["priority"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.swap = Histogram(
            "llm_kv_swap_seconds",
            "Time to move one batch of KV blocks between device and host",
            ["direction"],
            buckets=SWAP_BUCKETS,
            registry=r,
        )
        self._declare_model_series()
        self.rejections = Counter(
            "tierserve_rejections",
            "Requests refused before the engine, by reason",
            ["reason", "priority"],
            registry=r,
        )
        self.outcomes = Counter(
            "tierserve_requests",
            "Requests that reached the engine, by how they ended",
            ["priority", "finish_reason"],
            registry=r,
        )
        self._start_at_zero()
        self.disconnects = Counter(
            "tierserve_client_disconnects", "Clients gone before their request ended", registry=r
        )
        self.http_errors = http_errors_counter(r)
        self._sla_lock = threading.Lock()
        self._sla: dict[tuple[Tier, Tier], list[int]] = {}  # (run tier, entitled tier) -> [met, total]
        self._engine_families: Sequence[Metric] = ()  # the engine process's, as it answered last
        self._state = StateCollector(model_name, self.sla_counts)
        r.register(self._state)
        # Generated tokens counted by the handlers (`count_generated`) since the last exposition:
        # a plain sum on the event loop, folded into `vllm:generation_tokens` when rendered (a
        # Counter.inc costs 0.86 us, once per delta of every stream).
        self._generated_unrendered = 0

    def count_generated(self, num_tokens: int) -> None:
        """Tokens a response used (on the server's event loop, like `render`)."""
        self._generated_unrendered += num_tokens

    def _declare_model_series(self) -> None:
        """The series vLLM exports under the same names, labelled with the model."""
        r, m, model = self.registry, ["model_name"], self._model
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", m, buckets=TTFT_BUCKETS, registry=r
        ).labels(model)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        ).labels(model)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to finish", m, buckets=E2E_BUCKETS, registry=r
        ).labels(model)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of started requests", m, registry=r
        ).labels(model)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", m, registry=r).labels(
            model
        )

    def _start_at_zero(self) -> None:
        """Each tier's waits, refusals and outcomes exported at 0 from the start."""
        for tier in ALL_TIERS:
            self.wait.labels(tier.name)
            for reason in REJECTION_REASONS:
                self.rejections.labels(reason, tier.name)
            for reason in FINISH_REASONS:
                self.outcomes.labels(tier.name, reason)
        self.rejections.labels("draining", "none")  # refused before its tier was read

    def bind(
        self, snapshot: Callable[[], EngineSnapshot] | None, limiter: Callable[[], LimiterState] | None
    ) -> None:
        """Where scrape-time state comes from (None: leave as it is)."""
        if snapshot is not None:
            self._state.snapshot = snapshot
        if limiter is not None:
            self._state.limiter = limiter

    def observe_first_token(self, tier: Tier, wait_s: float, num_prompt_tokens: int) -> None:
        self.wait.labels(tier.name).observe(wait_s)
        self.ttft.observe(wait_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def observe_finished(
        self, tier: Tier, entitled: Tier, ttft_s: float | None, e2e_s: float, reason: str
    ) -> None:
        self.e2e.observe(e2e_s)
        self.outcomes.labels(tier.name, reason).inc()
        target = self._targets.get(tier, math.inf)
        if ttft_s is None:
            # Ended with no token (the client gave up, a drain): a miss once it had waited
            # past the target, or the worst misses of all were left out; too soon to tell
            # otherwise.
            if e2e_s <= target:
                return
            met = False
        else:
            met = ttft_s <= target
        with self._sla_lock:
            counts = self._sla.setdefault((tier, entitled), [0, 0])
            counts[0] += met
            counts[1] += 1

    def count_http_error(self, reason: str) -> None:
        self.http_errors.labels(reason).inc()

    def reject(self, reason: str, tier: Tier | None) -> None:
        self.rejections.labels(reason, "none" if tier is None else tier.name).inc()

    def sla_counts(self) -> dict[tuple[Tier, Tier], tuple[int, int]]:
        """(met, missed) by (run tier, entitled tier), since start-up."""
        with self._sla_lock:
            return {k: (met, total - met) for k, (met, total) in self._sla.items()}

    def render(self, engine_families: Sequence[Metric] = ()) -> bytes:
        """The exposition text; `engine_families`: the engine process's, merged in (its
        counters and histograms add to this registry's, which hold zero for them).

        An empty `engine_families` (the engine did not answer in time) once some have come:
        the last ones stand in, stale but never lower, so its counters never read as reset."""
        if self._generated_unrendered:
            self.generation_tokens.inc(self._generated_unrendered)
            self._generated_unrendered = 0
        if engine_families:
            self._engine_families = engine_families
        if not self._engine_families:
            return generate_latest(self.registry)
        return generate_latest(_Merged(merge_families(list(self.registry.collect()), self._engine_families)))


def merge_families(ours: Sequence[Metric], theirs: Sequence[Metric]) -> list[Metric]:
    """Families of the same name merged sample by sample: values add up, except `_created`
    timestamps (the earlier is kept). A family only one side has is kept as it is."""
    merged: dict[str, Metric] = {}
    for family in (*ours, *theirs):
        have = merged.get(family.name)
        if have is None:
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = list(family.samples)
            merged[family.name] = copy
            continue
        index = {(s.name, tuple(sorted(s.labels.items()))): i for i, s in enumerate(have.samples)}
        for sample in family.samples:
            i = index.get((sample.name, tuple(sorted(sample.labels.items()))))
            if i is None:
                have.samples.append(sample)
                continue
            old = have.samples[i]
            value = (
                min(old.value, sample.value) if sample.name.endswith("_created") else old.value + sample.value
            )
            have.samples[i] = old._replace(value=value)
    return list(merged.values())


class _Merged:
    """A collector of fixed families, for `generate_latest`."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
