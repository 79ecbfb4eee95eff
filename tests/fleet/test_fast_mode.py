"""Fast replicas (`Engine(fast=True)`) give the fleet's step-by-step results, request by
request: leaps stop wherever something could reach a replica or read its state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierserve.bench.sim_speed import compare
from tierserve.clock import VirtualClock
from tierserve.engine import Engine
from tierserve.fleet.autoscaler import AutoscaleConfig, ScalingPolicy
from tierserve.fleet.sim import FleetConfig, FleetSim
from tierserve.workloads import TierMix, load_trace, trace_stream
from tierserve.workloads.spec import RequestSpec

from .helpers import CONFIG, build_engine, specs


def _fast_engine(clock: VirtualClock) -> Engine:
    step = build_engine(clock)
    return Engine(CONFIG, "hybrid", step.executor, clock, fast=True)


def _run(config: FleetConfig, workload: list[RequestSpec], fast: bool) -> tuple[Any, int]:
    engines: list[Engine] = []

    def build(clock: VirtualClock) -> Engine:
        engine = _fast_engine(clock) if fast else build_engine(clock)
        engines.append(engine)
        return engine

    result = FleetSim(config, build).run(workload)
    leapt = sum(e.stats.num_leapt_steps for e in engines)
    reported = {
        "requests": [
            (fr.index, fr.outcome, fr.first_token_s, fr.finish_s, fr.attempts, tuple(fr.tried))
            for fr in result.requests
        ],
        "end_s": result.end_s,
        "gpu_seconds": result.gpu_seconds,
        "replicas": result.replicas_over_time,
        "routed": result.routed_by_reason,
        "launched": result.num_launched,
    }
    return reported, leapt


def _assert_same(config: FleetConfig, workload: list[RequestSpec]) -> Any:
    step, none_leapt = _run(config, workload, fast=False)
    fast, leapt = _run(config, workload, fast=True)
    assert none_leapt == 0 and leapt > 0
    comparison = compare(step, fast)
    assert comparison.mismatches == 0 and comparison.max_rel_diff == 0.0
    return step


@pytest.mark.parametrize("router", ["tier-aware", "least-loaded"])
def test_fast_replicas_give_the_step_by_step_fleet(router: str) -> None:
    workload = specs(150, seed=5, gap_s=0.04, prompt=(50, 1200), output=(20, 400))
    _assert_same(FleetConfig(3, router=router), workload)


def test_fast_replicas_with_autoscaling_and_a_fault() -> None:
    workload = specs(150, seed=7, gap_s=0.03, prompt=(50, 1200), output=(20, 300))
    autoscale = AutoscaleConfig(
        policy=ScalingPolicy.TIER, interval_s=1.0, startup_delay_s=1.0, idle_s=2.0, max_replicas=4
    )
    step = _assert_same(FleetConfig(2, autoscale=autoscale, kills=((2.0, 0),)), workload)
    assert step["launched"] > 2  # scaled out
    assert any(outcome == "lost" for _, outcome, *_ in step["requests"])  # the fault cost requests


def test_fast_replicas_on_a_trace(shared_data: Path) -> None:
    rows = load_trace(shared_data / "AzureLLMInferenceTrace_code.csv")[:300]
    max_model_len = build_engine(VirtualClock()).spec.max_model_len
    workload = list(trace_stream(rows, 0, max_model_len, TierMix(), 4.0))
    _assert_same(FleetConfig(4), workload)


def test_a_run_cut_off_by_its_drain_deadline_ends_at_the_deadline_in_both_modes() -> None:
    # Answers too long for the drain time, which ends between two scrapes: a fast replica's
    # leap passes the steps that end before the deadline, so the run's end (the requests left
    # unfinished, the GPU time) was the last event each mode happened to handle.
    workload = specs(4, seed=3, gap_s=0.1, prompt=(100, 300), output=(20_000, 30_000))
    config = FleetConfig(1, drain_timeout_s=7.25)
    step = _assert_same(config, workload)
    assert step["end_s"] == workload[-1].arrival_s + 7.25
    assert all(outcome == "unfinished" for _, outcome, *_ in step["requests"])
