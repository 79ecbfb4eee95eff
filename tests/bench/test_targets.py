from __future__ import annotations

from typing import Any

import pytest

from tierserve.bench.driver import NEVER_STARTED, RUN_ENDED
from tierserve.bench.report import _load_label, _preempt, _sig3
from tierserve.bench.targets import Verdict, binomial_below, judge


def run(
    policy: str, p0: float, p1: float, goodput: float | None, load: float = 1.5, **extra: Any
) -> dict[str, Any]:
    tier = {"requests": 10, "completed": 10, "shed": 0}
    return {
        "policy": policy,
        "workload": "default",
        "pattern": "poisson",
        "arrival": "open",
        "load": load,
        "tiers": {
            "P0": {**tier, "slo_attainment": p0, "preempted": 0},
            "P1": {**tier, "slo_attainment": p1},
            "P3": {**tier},
        },
        "goodput_rps": goodput,
        "throughput_vs_fcfs": 1.0,
        "p3_completed": 10,
        "p3_shed": 0,
        "p3_shed_reasons": {},
        "p0_slowdown_p95": 1.2,
        "p0_idle_over_slo_share": 0.0,
        "p0_fits_alone": {"requests": 10, "slo_attainment": p0},
        "p0_long_alone": {"requests": 0, "slowdown_p95": None},
        **extra,
    }


def others(load: float = 1.5, goodput: float = 1.0) -> list[dict[str, Any]]:
    """The baselines besides vllm-priority, behind it: "every baseline" needs them all."""
    return [run(b, 0.9, 0.9, goodput, load=load) for b in ("fcfs", "sglang-priority", "article")]


def test_hybrid_is_judged_against_the_numbers_and_the_baselines() -> None:
    runs = [run("hybrid", 0.995, 0.90, 7.0), run("vllm-priority", 0.9, 0.95, 7.5), *others()]
    got = {v.target: v.met for v in judge(runs)}
    assert [met for target, met in got.items() if target.startswith("P0")] == [True]
    assert [met for target, met in got.items() if target.startswith("beyond")] == [False]  # 90 % < 95 %
    assert [met for target, met in got.items() if target.startswith("goodput")] == [False]  # 7.0 < 7.5
    # The detail names the best baseline and how far behind it hybrid is.
    goodput = next(v for v in judge(runs) if v.target.startswith("goodput"))
    assert goodput.detail.endswith("7.0000 vs best baseline 7.5000 rps (vllm-priority, -6.67 %)")
    assert [met for target, met in got.items() if target.startswith("P1 SLO")] == [None]  # no cell <= 1.0x


def test_the_goodput_detail_shows_the_gap_seed_by_seed() -> None:
    """Pooled, hybrid was 0.01 % under vllm-priority; seed by seed the sign flips, which the
    verdict's line now shows (the verdict itself stays on the pooled figures)."""
    runs = [
        run("hybrid", 0.995, 0.90, 7.0, goodput_rps_by_seed=[7.07, 6.93]),
        run("vllm-priority", 0.9, 0.95, 7.5, goodput_rps_by_seed=[7.0, 7.0]),
        *others(),
    ]
    goodput = next(v for v in judge(runs) if v.target.startswith("goodput"))
    assert goodput.met is False
    assert goodput.detail.endswith("(vllm-priority, -6.67 %; seed by seed +1.00, -1.00 %)")


def test_p0_prompts_too_long_for_the_slo_alone_are_judged_by_slowdown_the_others_by_the_slo() -> None:
    def verdict(fits: float | None, long_slowdown: float | None) -> bool | None:
        cell = run("hybrid", 0.5, 1.0, 1.0)
        cell["p0_fits_alone"] = {"requests": 0 if fits is None else 60, "slo_attainment": fits}
        cell["p0_long_alone"] = {
            "requests": 0 if long_slowdown is None else 40,
            "slowdown_p95": long_slowdown,
        }
        return next(v for v in judge([cell]) if v.target.startswith("P0")).met

    assert verdict(None, 1.4) is True  # only long prompts: slowdown decides, whatever the tier's 50 %
    assert verdict(None, 1.6) is False
    assert verdict(0.995, 1.4) is True
    assert verdict(0.98, 1.4) is False  # the short prompts still answer to the SLO
    assert verdict(0.995, 1.6) is False
    assert verdict(None, None) is None  # no P0 request: not judged


def test_a_p3_request_never_started_fails_the_p3_target_and_one_shed_or_generating_does_not() -> None:
    """Every request ends with some reason, so "shed with a reason" could not fail: one still
    waiting for its first token when the run ended was neither served nor shed."""

    def verdict(reason: str) -> Verdict:
        cell = run("hybrid", 1.0, 1.0, 1.0, p3_completed=9, p3_shed=1, p3_shed_reasons={reason: 1})
        cell["tiers"]["P3"] = {"requests": 10, "completed": 9, "shed": 1}
        return next(v for v in judge([cell]) if v.target.startswith("every P3"))

    cut = verdict(NEVER_STARTED)
    assert (
        cut.met is False
        and "9 completed, 1 shed (10.00 %), 1 not yet started when the run ended" in cut.detail
    )
    shed = verdict("shed: P3 over its deadline")
    assert shed.met is True
    assert "(1 shed: P3 over its deadline)" in shed.detail and "{" not in shed.detail  # words, not a dict
    assert verdict(RUN_ENDED).met is True  # a long answer still being generated: in progress


def test_p0_waiting_for_lower_tier_memory_fails_the_memory_pressure_target() -> None:
    def verdict(waited: int | None) -> bool | None:
        cell = run("hybrid", 1.0, 1.0, 1.0, workload="memory-pressure")
        if waited is not None:
            cell["tiers"]["P0"]["waited_for_lower_memory"] = waited
        return next(v for v in judge([cell]) if v.target.startswith("under memory pressure")).met

    assert verdict(0) is True
    assert verdict(3) is False
    assert verdict(None) is None  # results written before the count existed: not judged


def test_a_cell_that_measured_nothing_meets_no_target() -> None:
    empty = run("hybrid", 1.0, 1.0, 0.0)
    for tier in empty["tiers"].values():
        tier["requests"] = 0
    verdicts = judge([empty, run("vllm-priority", 0.0, 0.0, 0.0, throughput_vs_fcfs=None)])
    assert all(v.met is None for v in verdicts)  # NOT RUN, never MET on no requests
    assert all("no measured requests" in v.detail for v in verdicts if v.detail != "no cell applies")


def test_the_p3_target_is_not_met_on_a_cell_without_p3_requests() -> None:
    no_p3 = run("hybrid", 1.0, 1.0, 1.0, p3_completed=0)
    no_p3["tiers"]["P3"] = {"requests": 0, "completed": 0, "shed": 0}
    assert next(v for v in judge([no_p3]) if v.target.startswith("every P3")).met is None


def test_a_load_label_stays_readable_when_a_burst_makes_the_offered_load_huge() -> None:
    cell = run("hybrid", 1.0, 1.0, 1.0, load=1.0, pattern="bursty")
    assert _load_label({**cell, "peak_offered_load_x_capacity": 1.3e79}) == "1x (busiest minute 1.3e+79x)"
    assert _load_label({**cell, "peak_offered_load_x_capacity": 2.345}) == "1x (busiest minute 2.35x)"


def test_goodput_that_was_not_measured_is_not_judged() -> None:
    for mine, theirs in ((None, 7.0), (7.0, None)):
        runs = [run("hybrid", 1.0, 1.0, mine), run("vllm-priority", 1.0, 1.0, theirs)]
        assert next(v for v in judge(runs) if v.target.startswith("goodput")).met is None


def test_p0_is_not_judged_on_a_cell_with_too_few_p0_requests() -> None:
    few = run("hybrid", 1.0, 1.0, 1.0, low_sample=True)
    verdict = next(v for v in judge([few]) if v.target.startswith("P0"))
    assert verdict.met is None and "too few P0 requests" in verdict.detail


def test_throughput_is_not_judged_on_a_small_run() -> None:
    """A --quick run's first benchmark said NOT MET on a ratio of a few hundred requests;
    a long run is judged, with or without P0 requests."""
    few = run("hybrid", 1.0, 1.0, 1.0, throughput_vs_fcfs=0.95)  # 30 requests
    verdict = next(v for v in judge([few]) if v.target.startswith("throughput"))
    assert verdict.met is None and "0.950x (fewer than 1000 requests: not judged)" in verdict.detail
    long_without_p0 = run("hybrid", 1.0, 1.0, 1.0, low_sample=True, throughput_vs_fcfs=0.95)
    long_without_p0["tiers"]["P1"]["requests"] = 5000
    assert next(v for v in judge([long_without_p0]) if v.target.startswith("throughput")).met is False


def test_a_tier_mix_without_p1_leaves_the_p1_targets_not_run() -> None:
    no_p1 = run("hybrid", 1.0, None, 1.0, load=0.8)  # type: ignore[arg-type]
    no_p1["tiers"]["P1"] = {"requests": 0, "completed": 0, "shed": 0, "slo_attainment": None}
    verdicts = {v.target: v.met for v in judge([no_p1, run("vllm-priority", 1.0, None, 1.0, load=0.8)])}  # type: ignore[arg-type]
    assert [met for target, met in verdicts.items() if target.startswith(("P1", "beyond"))] == [None, None]


def test_a_target_missed_in_one_cell_is_not_met_even_where_another_cell_cannot_be_judged() -> None:
    # Goodput measured and behind the best baseline in one cell, unmeasured in the other.
    runs = [
        run("hybrid", 1.0, 1.0, 1.9, load=1.0),
        run("vllm-priority", 1.0, 1.0, 3.0, load=1.0),
        *others(load=1.0),
        run("hybrid", 1.0, 1.0, None, load=4.0),
        run("vllm-priority", 1.0, 1.0, 3.0, load=4.0),
        *others(load=4.0),
    ]
    verdict = next(v for v in judge(runs) if v.target.startswith("goodput"))
    assert verdict.label() == "NOT MET" and "-36.67 %" in verdict.detail


def test_goodput_against_every_baseline_is_not_run_without_all_of_them() -> None:
    """A matrix of fcfs and hybrid read MET: "every baseline" was fcfs alone."""
    runs = [run("hybrid", 1.0, 1.0, 7.0), run("fcfs", 1.0, 1.0, 5.0)]
    verdict = next(v for v in judge(runs) if v.target.startswith("goodput"))
    assert verdict.met is None
    assert "7.0000 rps; not run: vllm-priority, sglang-priority, article" in verdict.detail


def test_a_clear_p0_miss_on_few_requests_is_not_met() -> None:
    """90.9 % of 121 P0 requests read NOT RUN (too few to judge); a miss that clear is a miss.
    A small cell is still never MET."""

    def verdict(attainment: float, n: int, long_ci: list[float] | None = None) -> bool | None:
        cell = run("hybrid", attainment, 1.0, 1.0, low_sample=True)
        cell["p0_fits_alone"] = {"requests": n, "slo_attainment": attainment}
        if long_ci is not None:
            cell["p0_long_alone"] = {
                "requests": 20,
                "slowdown_p95": long_ci[0] + 0.1,
                "slowdown_p95_ci": long_ci,
            }
        return next(v for v in judge([cell]) if v.target.startswith("P0")).met

    assert verdict(110 / 121, 121) is False
    assert verdict(1.0, 121) is None  # all met, but on too few to say 99 %
    assert verdict(119 / 121, 121) is None  # 98.3 %: within what 121 requests can tell from 99 %
    assert verdict(1.0, 121, long_ci=[1.6, 2.4]) is False  # the slowdown's interval wholly over 1.5
    assert verdict(1.0, 121, long_ci=[1.2, 2.4]) is None
    assert verdict(19 / 20, 20) is None  # one miss in 20: a 99 % rate does that 18 % of the time
    assert binomial_below(19, 20, 0.99) == pytest.approx(1 - 0.99**20)
    assert binomial_below(110, 121, 0.99) < 1e-6 and binomial_below(121, 121, 0.99) == 1.0
    assert binomial_below(0, 1, 0.99) == pytest.approx(0.01)
    assert binomial_below(3, 4, 1.0) == 0.0 and binomial_below(0, 4, 0.0) == 1.0


def test_a_p0_miss_just_under_the_target_does_not_print_as_the_target() -> None:
    cell = run("hybrid", 0.98974, 1.0, 1.0)
    cell["p0_fits_alone"] = {"requests": 400, "slo_attainment": 0.98974}
    verdict = next(v for v in judge([cell]) if v.target.startswith("P0"))
    assert verdict.met is False and "98.97 % of 400" in verdict.detail


@pytest.mark.parametrize(("offered", "judged_up_to_capacity"), [(0.63, True), (1.2, False), (None, False)])
def test_a_trace_cell_within_capacity_answers_to_the_p1_target(
    offered: float | None, judged_up_to_capacity: bool
) -> None:
    """A trace whose arrivals come at 0.63x the measured capacity is a load within capacity:
    its P1 answers to >= 95 % (hybrid's 69 % there read as judged only against
    vllm-priority's 58 %). Over capacity, or where capacity was not measured, it is judged
    as beyond capacity."""
    cells = [
        run(p, 1.0, p1, 1.0, pattern="trace", offered_load_x_capacity=offered)
        for p, p1 in (("hybrid", 0.69), ("vllm-priority", 0.58))
    ]
    got = {v.target.split(" ")[0]: v for v in judge(cells)}
    p1 = next(v for v in judge(cells) if v.target.startswith("P1 SLO"))
    beyond = got["beyond"]
    assert p1.met is (False if judged_up_to_capacity else None)
    assert beyond.met is (None if judged_up_to_capacity else True)


def test_a_slowdown_p95_of_a_handful_of_p0_prompts_is_not_judged_met() -> None:
    """Four P0 prompts that alone miss the SLO have a slowdown "P95" that is their maximum:
    1.45x read as MET beside 300 P0 requests in all. A clear miss is still NOT MET."""

    def verdict(n: int, p95: float, interval: list[float]) -> tuple[bool | None, str]:
        cell = run("hybrid", 1.0, 1.0, 1.0)
        cell["p0_fits_alone"] = {"requests": 400, "slo_attainment": 1.0}
        cell["p0_long_alone"] = {"requests": n, "slowdown_p95": p95, "slowdown_p95_ci": interval}
        found = next(v for v in judge([cell]) if v.target.startswith("P0"))
        return found.met, found.detail

    met, detail = verdict(4, 1.45, [1.2, 1.6])
    assert met is None and "fewer than 20" in detail
    assert verdict(4, 3.0, [2.0, 4.0])[0] is False
    assert verdict(40, 1.45, [1.2, 1.6])[0] is True


def test_preemptions_gpu_time_keeps_three_significant_digits() -> None:
    """To a tenth of a second, 20 swaps' 0.0288 s read as 0.0 s in the report's table."""
    cell = {
        "preemptions": {"swap": 20, "recompute": 0, "reclaim": 20},
        "preemption_gpu_s": {"swap_s": 0.0288, "recompute_prefill_s": 101.04},
    }
    assert _preempt(cell) == "20/0/20 (0.0288 s swap, 101 s prefill)"
    # Past a thousand seconds, whole seconds, not 1.2e+03.
    cell["preemption_gpu_s"] = {"swap_s": 1199.6, "recompute_prefill_s": 1763.2}
    assert _preempt(cell) == "20/0/20 (1,200 s swap, 1,763 s prefill)"


def test_seconds_print_in_three_digits_and_never_in_exponent_form() -> None:
    assert [_sig3(x) for x in (0.0, 0.0004, 0.0288, 101.04, 1763.2)] == [
        "0",
        "<0.001",
        "0.0288",
        "101",
        "1,763",
    ]
