from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tierserve.bench.cell import Cell, CellResult
from tierserve.bench.driver import DriverResult
from tierserve.bench.metrics import Preemption, RequestRecord, Window
from tierserve.bench.report import warnings
from tierserve.bench.summary import MIN_P0_REQUESTS, summarize
from tierserve.config import EngineConfig
from tierserve.engine import EngineStats
from tierserve.request import RequestStatus
from tierserve.tiers import Tier


def record(
    index: int,
    tier: Tier,
    arrival: float,
    ttft: float | None,
    status: RequestStatus = RequestStatus.FINISHED,
    reason: str = "length",
    preemptions: tuple[Preemption, ...] = (),
    admitted: tuple[float, ...] = (),
) -> RequestRecord:
    first = None if ttft is None else arrival + ttft
    return RequestRecord(
        f"r{index}", index, tier, True, status, arrival, first, arrival + (ttft or 0) + 1.0,
        100, 11, 0, 0, 0, reason, preemptions, admitted,
    )  # fmt: skip


def result(
    records: list[RequestRecord], idle: dict[int, float], seed: int = 0, policy: str = "hybrid"
) -> CellResult:
    # The window runs from the first measured arrival to the last measured end, as the driver's does.
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.finish_s for r in records), default=100.0)
    window = Window(start, end, 1000, 50.0, 80.0, {}, 90)
    run = DriverResult(records, window, EngineStats(), 100.0)
    cost = {(p.swapped, p.amount): 0.5 for r in records for p in r.preemptions}
    return CellResult(Cell("default", "poisson", 1.0, policy, seed), run, idle, 100, cost, 2.0)


def test_p0_slowdown_is_per_request_not_a_ratio_of_percentiles() -> None:
    records = [record(0, Tier.P0, 0.0, 1.0), record(1, Tier.P0, 5.0, 0.2), record(2, Tier.P0, 9.0, 0.3)]
    idle = {0: 1.0, 1: 0.1, 2: 0.3}  # slowdowns 1, 2 and 1
    out = summarize([result(records, idle)], EngineConfig())
    assert out["p0_slowdown_p95"] == pytest.approx(float(np.percentile([1.0, 2.0, 1.0], 95)))
    ratio_of_p95s = np.percentile([1.0, 0.2, 0.3], 95) / np.percentile([1.0, 0.1, 0.3], 95)
    assert out["p0_slowdown_p95"] != pytest.approx(ratio_of_p95s)
    assert out["p0_idle_over_slo_share"] == pytest.approx(1 / 3)  # the 1 s prompt alone misses 0.5 s
    # The split the P0 target judges by: the 1 s prompt by its slowdown, the others by the SLO.
    long_alone = out["p0_long_alone"]
    assert long_alone["requests"] == 1 and long_alone["slowdown_p95"] == pytest.approx(1.0)
    fits_alone = out["p0_fits_alone"]
    assert fits_alone["requests"] == 2 and fits_alone["slo_attainment"] == pytest.approx(1.0)
    # Apart in time, P0's own traffic alone never waits.
    assert fits_alone["p0_alone_attainment"] == 1.0 and long_alone["p0_alone_slowdown_p95"] == 1.0


def test_a_rejected_p0_request_is_a_miss_among_the_prompts_that_fit() -> None:
    records = [record(0, Tier.P0, 0.0, 0.2), record(1, Tier.P0, 1.0, None, RequestStatus.REJECTED, "x")]
    out = summarize([result(records, {0: 0.1, 1: 0.1})], EngineConfig())
    assert out["p0_fits_alone"]["requests"] == 2
    assert out["p0_fits_alone"]["slo_attainment"] == pytest.approx(0.5)


def test_p0_alone_reference_counts_what_p0_requests_arriving_together_cost_each_other() -> None:
    # Three 0.3 s prompts at once: alone on an ideal server two end after 0.5 s (0.6, 0.9).
    records = [record(i, Tier.P0, 0.0, 0.3) for i in range(3)]
    out = summarize([result(records, {0: 0.3, 1: 0.3, 2: 0.3})], EngineConfig())
    assert out["p0_fits_alone"]["p0_alone_attainment"] == pytest.approx(1 / 3)


def test_attainment_goodput_and_p3_shed_reasons() -> None:
    records = [
        record(0, Tier.P1, 0.0, 1.0),
        record(1, Tier.P1, 5.0, 9.0),  # misses the 5 s target
        record(2, Tier.P3, 6.0, 2.0),
        record(3, Tier.P3, 10.0, None, RequestStatus.ABORTED, "still unfinished when the run ended"),
        record(4, Tier.P3, 10.0, None, RequestStatus.REJECTED, "too long"),
    ]
    out = summarize([result(records, {})], EngineConfig())
    p1 = out["tiers"]["P1"]
    assert p1["requests"] == 2 and p1["slo_attainment"] == 0.5
    assert p1["goodput_rps"] == pytest.approx(1 / 10)  # one within SLO over 10 s of arrivals
    assert (out["p3_completed"], out["p3_shed"]) == (1, 2)
    assert out["p3_shed_reasons"] == {"still unfinished when the run ended": 1, "too long": 1}
    assert out["tiers"]["P3"]["ttft_p95_s"] is not None  # the aborted one counts its wait


def test_open_loop_goodput_counts_over_the_workloads_own_arrivals() -> None:
    # The last turn of a conversation was held until its previous answer came (at 10 s,
    # under some policy), though the workload sent it at 4 s: the offered load spans 4 s.
    records = [record(0, Tier.P1, 0.0, 1.0), record(1, Tier.P1, 10.0, 1.0)]
    records = [replace(records[0], scheduled_s=0.0), replace(records[1], scheduled_s=4.0)]
    out = summarize([result(records, {})], EngineConfig())
    assert out["tiers"]["P1"]["goodput_rps"] == pytest.approx(2 / 4)


def test_goodput_is_not_measured_over_arrivals_shorter_than_their_latency() -> None:
    # 50 requests sent within a microsecond, served one every 0.1 s: over their arrival span
    # they would claim 5e7 requests a second.
    burst = [replace(record(i, Tier.P3, 1e-8 * i, 0.05), finish_s=0.1 * (i + 1)) for i in range(50)]
    out = summarize([result(burst, {})], EngineConfig())
    assert out["goodput_rps"] is None and out["tiers"]["P3"]["goodput_rps"] is None
    assert "median latency (2.55 s)" in out["goodput_unmeasured"]
    assert any("goodput not measured" in w for w in warnings([out]))
    assert out["tiers"]["P3"]["slo_attainment"] == 1.0  # the rest is measured as ever
    # Arrivals as steady as their service: the span of the arrivals stands.
    steady = [replace(record(i, Tier.P3, float(i), 0.05), finish_s=i + 0.5) for i in range(50)]
    out = summarize([result(steady, {})], EngineConfig())
    assert out["goodput_rps"] == pytest.approx(50 / 49) and out["goodput_unmeasured"] is None
    assert not any("goodput" in w for w in warnings([out]))
    # Pooled with a seed whose goodput cannot be measured, the cell's cannot either.
    pooled = summarize([result(steady, {}), result(burst, {}, seed=1)], EngineConfig())
    assert pooled["goodput_rps"] is None


def test_a_preemption_in_a_step_that_admitted_a_more_urgent_request_is_a_reclaim() -> None:
    reclaimed = Preemption(5.0, True, 8)
    grown = Preemption(7.0, False, 300)
    records = [
        record(0, Tier.P2, 0.0, 1.0, preemptions=(reclaimed, grown)),
        record(1, Tier.P0, 4.9, 0.2, admitted=(5.0,)),
        record(2, Tier.P3, 6.9, 0.2, admitted=(7.0,)),  # less urgent than the victim
    ]
    out = summarize([result(records, {1: 0.2})], EngineConfig())
    assert out["preemptions"] == {"swap": 1, "recompute": 1, "reclaim": 1}
    assert out["preemption_gpu_s"] == {"swap_s": 0.5, "recompute_prefill_s": 0.5}


def test_seeds_pool_their_requests() -> None:
    a = result([record(0, Tier.P0, 0.0, 0.1), record(1, Tier.P1, 1.0, 0.1)], {0: 0.1}, seed=0)
    b = result([record(0, Tier.P0, 0.0, 0.9), record(1, Tier.P1, 2.0, 0.1)], {0: 0.1}, seed=1)
    out = summarize([a, b], EngineConfig())
    assert out["seed"] == [0, 1] and out["tiers"]["P0"]["requests"] == 2
    assert out["tiers"]["P0"]["slo_attainment"] == 0.5
    with pytest.raises(ValueError):
        summarize([a, result([], {}, policy="fcfs")], EngineConfig())


def test_cells_with_too_few_p0_requests_are_warned_about() -> None:
    few = summarize([result([record(i, Tier.P0, i, 0.1) for i in range(10)], {})], EngineConfig())
    enough = summarize(
        [result([record(i, Tier.P0, i, 0.1) for i in range(MIN_P0_REQUESTS)], {})], EngineConfig()
    )
    assert few["low_sample"] and not enough["low_sample"]
    warned = warnings([few, enough])
    assert len(warned) == 1 and "10 requests" in warned[0]


def test_open_loop_offered_load_is_against_capacity_over_the_window_and_its_busiest_minute() -> None:
    # 45 arrivals over 300 s, 20 of them inside one minute; capacity 0.5 requests/s.
    grid = [float(t) for t in range(0, 300, 10) if not 100 <= t < 160]
    times = [*sorted(grid + [100.0 + 3 * k for k in range(20)]), 300.0]
    records = [record(i, Tier.P1, t, 0.1) for i, t in enumerate(times)]
    res = replace(result(records, {}), capacity_rps=0.5)
    out = summarize([res], EngineConfig())
    assert out["offered_load_x_capacity"] == pytest.approx((len(times) - 1) / 300 / 0.5, rel=1e-4)
    busiest = max(sum(1 for u in times if t <= u < t + 60) for t in times)
    assert busiest == 20
    assert out["peak_offered_load_x_capacity"] == pytest.approx(20 / 60 / 0.5, rel=1e-4)
    # Pooled over seeds: the same offered load, and the busiest minute of either.
    pooled = summarize([res, replace(res, cell=replace(res.cell, seed=1))], EngineConfig())
    assert pooled["offered_load_x_capacity"] == pytest.approx(out["offered_load_x_capacity"], rel=1e-4)
    assert pooled["peak_offered_load_x_capacity"] == out["peak_offered_load_x_capacity"]


def test_closed_loops_and_unmeasured_capacity_report_no_offered_load() -> None:
    records = [record(i, Tier.P1, float(i), 0.1) for i in range(10)]
    closed = replace(result(records, {}), capacity_rps=0.5)
    closed = replace(closed, cell=replace(closed.cell, pattern="closed", load=8.0))
    unknown = replace(result(records, {}), capacity_rps=None)
    for res in (closed, unknown):
        out = summarize([res], EngineConfig())
        assert out["offered_load_x_capacity"] is None and out["peak_offered_load_x_capacity"] is None


def test_goodput_over_no_span_and_no_latency_says_why_it_is_not_measured() -> None:
    # A fleet whose one request was refused (every replica dead) had goodput null and no
    # reason: there was no latency to compare the span with.
    from tierserve.bench.summary import short_span

    assert short_span(0.0, []) is not None and "one instant" in (short_span(0.0, []) or "")
    assert short_span(5.0, []) is None  # a span and nothing finished: goodput is 0, measured
    assert short_span(1.0, [3.0, 4.0]) is not None and short_span(10.0, [3.0, 4.0]) is None


def test_each_seeds_goodput_is_kept_beside_the_pooled_one() -> None:
    """A pooled gap of 0.01 % says nothing of its sign seed by seed; the seeds' own goodputs
    say whether it is noise (results.json: `goodput_rps_by_seed`)."""
    one = [replace(record(i, Tier.P1, float(i), 0.05), finish_s=i + 0.5) for i in range(11)]  # 11 in 10 s
    two = [replace(record(i, Tier.P1, 2.0 * i, 0.05), finish_s=2 * i + 0.5) for i in range(11)]  # in 20 s
    two[3] = replace(two[3], first_token_s=two[3].arrival_s + 30.0)  # past P1's 5 s
    pooled = summarize([result(one, {}), result(two, {}, seed=1)], EngineConfig())
    assert pooled["goodput_rps_by_seed"] == [pytest.approx(1.1), pytest.approx(0.5)]
    assert pooled["goodput_rps"] == pytest.approx(21 / 30)
