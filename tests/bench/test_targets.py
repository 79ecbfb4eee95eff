from __future__ import annotations

from typing import Any

from tierserve.bench.targets import judge


def run(policy: str, p0: float, p1: float, goodput: float, load: float = 1.5, **extra: Any) -> dict[str, Any]:
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


def test_hybrid_is_judged_against_the_numbers_and_the_baselines() -> None:
    runs = [run("hybrid", 0.995, 0.90, 7.0), run("vllm-priority", 0.9, 0.95, 7.5)]
    got = {v.target: v.met for v in judge(runs)}
    assert [met for target, met in got.items() if target.startswith("P0")] == [True]
    assert [met for target, met in got.items() if target.startswith("beyond")] == [False]  # 90 % < 95 %
    assert [met for target, met in got.items() if target.startswith("goodput")] == [False]  # 7.0 < 7.5
    assert [met for target, met in got.items() if target.startswith("P1 SLO")] == [None]  # no cell <= 1.0x


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


def test_a_p3_request_without_a_reason_fails_the_p3_target() -> None:
    bad = run("hybrid", 1.0, 1.0, 1.0, p3_shed=1, p3_shed_reasons={"": 1})
    bad["tiers"]["P3"] = {"requests": 10, "completed": 9, "shed": 1}
    assert next(v for v in judge([bad]) if v.target.startswith("every P3")).met is False


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
