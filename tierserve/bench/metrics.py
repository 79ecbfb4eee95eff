"""What a benchmark run measured: per-request records, the measurement window, per-tier metrics.

Definitions (docs/benchmark.md restates them):
- TTFT = first token time - arrival time. A request that never got a token before the run
  ended counts with its wait so far (a lower bound; `num_censored` says how many).
- SLO attained: TTFT <= the tier's `ttft_target_s`; a tier with no target (P3) attains it
  by completing. Rejected requests miss it. Attainment = attained / measured requests.
- Inter-token latency (ITL) of a request = (finish - first token) / (output tokens - 1).
- Utilization = sum of the executor's roofline step times / elapsed time, over the window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tierserve.config import EngineConfig
from tierserve.request import EventKind, Request, RequestStatus, TimelineEvent
from tierserve.tiers import ALL_TIERS, Tier


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """The timeline of one final request, without its tokens (runs keep thousands)."""

    request_id: str
    index: int  # position in the workload stream
    tier: Tier
    measured: bool  # False for warm-up and cool-down requests
    status: RequestStatus
    arrival_s: float
    first_token_s: float | None
    finish_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens found in the prefix cache at first admission
    num_swaps: int
    num_recomputes: int
    end_reason: str = ""  # why it ended: the finish reason, or the rejection's message
    preemptions: tuple[Preemption, ...] = ()
    admitted_s: tuple[float, ...] = ()  # every admission and readmission

    @classmethod
    def of(cls, req: Request, index: int, measured: bool, end_reason: str = "") -> RequestRecord:
        if not req.status.is_final or req.finish_time is None:
            raise ValueError(f"{req.request_id} is not final")
        kinds = [e.kind for e in req.events]
        reason = end_reason or req.reject_reason or (req.finish_reason.value if req.finish_reason else "")
        return cls(
            req.request_id,
            index,
            req.tier,
            measured,
            req.status,
            req.arrival_time,
            req.first_token_time,
            req.finish_time,
            req.num_prompt_tokens,
            req.num_output_tokens,
            req.num_cached_tokens,
            kinds.count(EventKind.PREEMPTED_SWAP),
            kinds.count(EventKind.PREEMPTED_RECOMPUTE),
            reason,
            tuple(Preemption.of(e) for e in req.events if e.kind in _PREEMPTED),
            tuple(e.time for e in req.events if e.kind in _ADMITTED),
        )


_PREEMPTED = (EventKind.PREEMPTED_SWAP, EventKind.PREEMPTED_RECOMPUTE)
_ADMITTED = (EventKind.ADMITTED, EventKind.READMITTED)


@dataclass(frozen=True, slots=True)
class Preemption:
    time_s: float
    swapped: bool  # False: recomputed
    amount: int  # blocks swapped out, or tokens to recompute

    @classmethod
    def of(cls, event: TimelineEvent) -> Preemption:
        head = event.detail.split(" ", 1)[0]
        return cls(event.time, event.kind is EventKind.PREEMPTED_SWAP, int(head) if head.isdigit() else 0)


@dataclass(frozen=True, slots=True)
class BlockUsage:
    mean_used: float  # time-weighted over the window's steps
    peak_used: int
    mean_borrowed: float
    peak_borrowed: int


@dataclass
class BlockSampler:
    """Time-weighted KV block usage per tier, one sample per engine step."""

    _time_s: float = 0.0
    _used_s: list[float] = field(default_factory=lambda: [0.0] * len(ALL_TIERS))
    _borrowed_s: list[float] = field(default_factory=lambda: [0.0] * len(ALL_TIERS))
    _peak_used: list[int] = field(default_factory=lambda: [0] * len(ALL_TIERS))
    _peak_borrowed: list[int] = field(default_factory=lambda: [0] * len(ALL_TIERS))
    peak_total: int = 0  # most blocks in use at once, all tiers together

    def add(self, duration_s: float, used: Sequence[int], borrowed: Sequence[int]) -> None:
        self._time_s += duration_s
        self.peak_total = max(self.peak_total, sum(used))
        for t in range(len(ALL_TIERS)):
            self._used_s[t] += used[t] * duration_s
            self._borrowed_s[t] += borrowed[t] * duration_s
            self._peak_used[t] = max(self._peak_used[t], used[t])
            self._peak_borrowed[t] = max(self._peak_borrowed[t], borrowed[t])

    def usage(self) -> dict[Tier, BlockUsage]:
        span = self._time_s or 1.0
        return {
            t: BlockUsage(
                self._used_s[t] / span, self._peak_used[t], self._borrowed_s[t] / span, self._peak_borrowed[t]
            )
            for t in ALL_TIERS
        }


@dataclass(frozen=True, slots=True)
class Window:
    """Engine counters over the measurement window: first measured arrival to last measured end."""

    start_s: float
    end_s: float
    num_generated_tokens: int
    roofline_s: float
    busy_s: float
    blocks: Mapping[Tier, BlockUsage]
    peak_used_blocks: int = 0  # all tiers together

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class TierMetrics:
    num_measured: int
    completed: int
    rejected: int
    aborted: int  # still unfinished when the run ended
    num_censored: int  # no first token when the run ended: TTFT counted as the wait so far
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    e2e_p50_s: float | None
    e2e_p95_s: float | None
    e2e_p99_s: float | None
    slo_attainment: float | None
    max_wait_s: float | None  # longest arrival -> first token (or -> run end, if censored)
    prefix_hit_rate: float | None
    num_swaps: int
    num_recomputes: int


@dataclass(frozen=True, slots=True)
class RunMetrics:
    tiers: Mapping[Tier, TierMetrics]
    throughput_tokens_per_s: float
    utilization: float  # roofline time / elapsed time over the window
    busy_fraction: float  # time inside engine steps and swaps / elapsed time
    window_s: float
    num_swaps: int
    num_recomputes: int
    prefix_hit_rate: float | None
    blocks: Mapping[Tier, BlockUsage]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile; None without samples."""
    return float(np.percentile(values, q)) if len(values) else None


def _hit_rate(records: Sequence[RequestRecord]) -> float | None:
    asked = sum(r.num_prompt_tokens for r in records if r.status is not RequestStatus.REJECTED)
    return sum(r.num_cached_tokens for r in records) / asked if asked else None


def tier_metrics(records: Sequence[RequestRecord], target_s: float, end_s: float) -> TierMetrics:
    admitted = [r for r in records if r.status is not RequestStatus.REJECTED]
    censored = [r for r in admitted if r.first_token_s is None]
    waits = [(r.first_token_s if r.first_token_s is not None else end_s) - r.arrival_s for r in admitted]
    done = [r for r in records if r.status is RequestStatus.FINISHED]
    itls = [
        (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
        for r in done
        if r.first_token_s is not None and r.num_output_tokens > 1
    ]
    e2e = [r.finish_s - r.arrival_s for r in done]
    if math.isinf(target_s):
        attained = len(done)
    else:
        attained = sum(
            1 for r in admitted if r.first_token_s is not None and r.first_token_s - r.arrival_s <= target_s
        )
    return TierMetrics(
        num_measured=len(records),
        completed=len(done),
        rejected=len(records) - len(admitted),
        aborted=sum(r.status is RequestStatus.ABORTED for r in records),
        num_censored=len(censored),
        ttft_p50_s=percentile(waits, 50),
        ttft_p95_s=percentile(waits, 95),
        ttft_p99_s=percentile(waits, 99),
        itl_p50_s=percentile(itls, 50),
        itl_p95_s=percentile(itls, 95),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p95_s=percentile(e2e, 95),
        e2e_p99_s=percentile(e2e, 99),
        slo_attainment=attained / len(records) if records else None,
        max_wait_s=max(waits) if waits else None,
        prefix_hit_rate=_hit_rate(records),
        num_swaps=sum(r.num_swaps for r in records),
        num_recomputes=sum(r.num_recomputes for r in records),
    )


def run_metrics(records: Sequence[RequestRecord], window: Window, config: EngineConfig) -> RunMetrics:
    """Metrics of the measured requests (`record.measured`) and of the engine over the window."""
    measured = [r for r in records if r.measured]
    tiers = {
        t: tier_metrics([r for r in measured if r.tier == t], config.tier(t).ttft_target_s, window.end_s)
        for t in ALL_TIERS
    }
    span = window.duration_s
    return RunMetrics(
        tiers=tiers,
        throughput_tokens_per_s=window.num_generated_tokens / span if span > 0 else 0.0,
        utilization=window.roofline_s / span if span > 0 else 0.0,
        busy_fraction=window.busy_s / span if span > 0 else 0.0,
        window_s=span,
        num_swaps=sum(m.num_swaps for m in tiers.values()),
        num_recomputes=sum(m.num_recomputes for m in tiers.values()),
        prefix_hit_rate=_hit_rate(measured),
        blocks=window.blocks,
    )
