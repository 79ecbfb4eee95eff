from __future__ import annotations

import math

import pytest

from tierserve.bench.metrics import BlockSampler, RequestRecord, Window, run_metrics, tier_metrics
from tierserve.config import EngineConfig
from tierserve.request import EventKind, Request, RequestStatus, SamplingParams
from tierserve.tiers import Tier

FIN, REJ, ABT = RequestStatus.FINISHED, RequestStatus.REJECTED, RequestStatus.ABORTED


def record(
    tier: Tier = Tier.P1,
    status: RequestStatus = FIN,
    arrival: float = 0.0,
    first: float | None = 1.0,
    finish: float = 5.0,
    num_output: int = 5,
    num_prompt: int = 100,
    num_cached: int = 0,
    measured: bool = True,
) -> RequestRecord:
    return RequestRecord(
        "r", 0, tier, measured, status, arrival, first, finish, num_prompt, num_output, num_cached, 0, 0
    )


def test_percentiles_slo_and_itl_of_finished_requests() -> None:
    records = [record(first=float(t), finish=float(t) + 4.0) for t in range(1, 11)]  # TTFT 1..10 s
    m = tier_metrics(records, target_s=5.0, end_s=100.0)
    assert m.ttft_p50_s == pytest.approx(5.5)
    assert m.ttft_p95_s == pytest.approx(9.55)
    assert m.slo_attainment == pytest.approx(0.5)
    assert m.itl_p50_s == pytest.approx(1.0)  # 4 s over 4 gaps
    assert m.e2e_p50_s == pytest.approx(9.5)
    assert (m.completed, m.rejected, m.aborted, m.num_censored) == (10, 0, 0, 0)


def test_rejected_requests_miss_the_slo_but_have_no_ttft() -> None:
    m = tier_metrics(
        [record(first=0.1), record(status=REJ, first=None, finish=0.0)], target_s=0.5, end_s=10.0
    )
    assert m.slo_attainment == 0.5
    assert m.ttft_p99_s == pytest.approx(0.1)
    assert m.rejected == 1


def test_a_request_that_never_started_counts_its_wait_until_the_end() -> None:
    m = tier_metrics(
        [record(first=0.5), record(status=ABT, arrival=2.0, first=None, finish=30.0)],
        target_s=60.0,
        end_s=30.0,
    )
    assert m.max_wait_s == pytest.approx(28.0)
    assert m.num_censored == 1 and m.aborted == 1
    assert m.slo_attainment == 0.5


def test_a_tier_without_target_attains_by_completing() -> None:
    m = tier_metrics(
        [record(first=500.0, finish=900.0), record(status=ABT, first=3.0, finish=9.0)],
        target_s=math.inf,
        end_s=900.0,
    )
    assert m.slo_attainment == 0.5


def test_prefix_hit_rate_counts_cached_prompt_tokens() -> None:
    m = tier_metrics([record(num_prompt=100, num_cached=64), record(num_prompt=300, num_cached=0)], 1.0, 10.0)
    assert m.prefix_hit_rate == pytest.approx(64 / 400)


def test_empty_tier_has_no_percentiles() -> None:
    m = tier_metrics([], 1.0, 1.0)
    assert m.ttft_p95_s is None and m.slo_attainment is None and m.max_wait_s is None


def test_block_sampler_weights_by_step_time_and_keeps_peaks() -> None:
    sampler = BlockSampler()
    sampler.add(1.0, [10, 0, 0, 0], [0, 0, 0, 0])
    sampler.add(3.0, [2, 4, 0, 0], [0, 8, 0, 0])
    usage = sampler.usage()
    assert usage[Tier.P0].mean_used == pytest.approx((10 + 6) / 4)
    assert usage[Tier.P0].peak_used == 10
    assert usage[Tier.P1].mean_borrowed == pytest.approx(6.0) and usage[Tier.P1].peak_borrowed == 8


def test_run_metrics_use_only_measured_requests_and_the_window() -> None:
    records = [record(Tier.P0, first=0.2), record(Tier.P0, first=9.0, measured=False)]
    window = Window(
        10.0, 20.0, num_generated_tokens=500, roofline_s=6.0, busy_s=9.0, blocks=BlockSampler().usage()
    )
    m = run_metrics(records, window, EngineConfig())
    assert m.tiers[Tier.P0].num_measured == 1 and m.tiers[Tier.P0].slo_attainment == 1.0
    assert m.throughput_tokens_per_s == 50.0
    assert m.utilization == pytest.approx(0.6) and m.busy_fraction == pytest.approx(0.9)


def test_record_counts_preemptions_by_kind() -> None:
    req = Request("x", [1, 2, 3], SamplingParams(max_tokens=2), tier=Tier.P2, arrival_time=1.0)
    for kind in (EventKind.PREEMPTED_SWAP, EventKind.PREEMPTED_RECOMPUTE, EventKind.PREEMPTED_SWAP):
        req.record(2.0, kind)
    req.status, req.finish_time, req.first_token_time = FIN, 4.0, 3.0
    rec = RequestRecord.of(req, index=7, measured=True)
    assert (rec.num_swaps, rec.num_recomputes, rec.index, rec.tier) == (2, 1, 7, Tier.P2)
