"""A fleet of one replica is the single-engine bench: same requests, same times."""

from __future__ import annotations

import pytest

from tierserve.bench.driver import DriverConfig, run_workload
from tierserve.clock import VirtualClock
from tierserve.fleet.sim import FleetConfig, FleetSim
from tierserve.workloads import TierMix, load_trace, trace_stream

from .helpers import build_engine, specs


def _driver(workload: list) -> dict[int, tuple]:  # type: ignore[type-arg]
    clock = VirtualClock()
    config = DriverConfig(num_measured=len(workload), concurrency=None, drain_timeout_s=1e6)
    result = run_workload(build_engine(clock), clock, workload, config)
    return {r.index: (r.first_token_s, r.finish_s, r.status.value) for r in result.records}


def _fleet(workload: list, router: str) -> dict[int, tuple]:  # type: ignore[type-arg]
    result = FleetSim(FleetConfig(1, router=router), build_engine).run(workload)
    status = {"completed": "finished"}
    return {
        fr.index: (fr.first_token_s, fr.finish_s, status.get(fr.outcome or "", fr.outcome))
        for fr in result.requests
    }


@pytest.mark.parametrize("router", ["round-robin", "least-loaded", "prefix-affinity"])
def test_one_replica_fleet_gives_the_single_engine_results(router: str) -> None:
    # Arrivals land inside steps and queue up: the boundary hand-over is exercised.
    workload = specs(120, seed=3, gap_s=0.05, prompt=(50, 1500), output=(5, 120))
    expected = _driver(workload)
    got = _fleet(workload, router)
    assert got.keys() == expected.keys()
    assert got == expected


def test_one_replica_fleet_matches_on_a_trace(shared_data) -> None:  # type: ignore[no-untyped-def]
    rows = load_trace(shared_data / "AzureLLMInferenceTrace_code.csv")[:150]
    max_model_len = build_engine(VirtualClock()).spec.max_model_len
    workload = list(trace_stream(rows, 0, max_model_len, TierMix(), 3.0))
    assert _fleet(workload, "round-robin") == _driver(workload)
