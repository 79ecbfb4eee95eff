"""The fleet's size over time: what the autoscaler keeps after faults, and what the report plots."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest

from tierserve.fleet.autoscaler import AutoscaleConfig, Autoscaler, Observation, ScalingPolicy
from tierserve.fleet.requests import COMPLETED
from tierserve.fleet.sim import FleetConfig, FleetResult, FleetSim

from .helpers import build_engine, specs

GPUS = 8


def _empty(num_starting: int = 0) -> Observation:
    """Every replica dead: nothing serving, so no busy fraction and no waiting to read."""
    return Observation(0.0, 0, num_starting, [], [], 0, None)


@pytest.mark.parametrize("policy", [ScalingPolicy.UTILIZATION, ScalingPolicy.TIER])
def test_a_scaling_fleet_under_its_minimum_adds_a_replica_whatever_its_load(policy: ScalingPolicy) -> None:
    scaler = Autoscaler(AutoscaleConfig(policy, min_replicas=3, max_replicas=8))
    assert scaler.decide(_empty()) == 1
    assert scaler.decide(_empty(num_starting=1)) == 1
    assert scaler.decide(_empty(num_starting=2)) == 0  # at most max_starting load at once
    assert scaler.decide(_empty(num_starting=3)) == 0  # the minimum is on its way
    fixed = Autoscaler(AutoscaleConfig(ScalingPolicy.FIXED, min_replicas=3, max_replicas=8))
    assert fixed.decide(_empty()) == 0


def test_a_utilization_scaled_fleet_whose_replicas_all_die_at_the_start_recovers() -> None:
    scaling = AutoscaleConfig(ScalingPolicy.UTILIZATION, max_replicas=4, startup_delay_s=10.0)
    config = FleetConfig(2, autoscale=scaling, kills=((0.0, 0), (0.0, 1)))
    sim = FleetSim(config, build_engine)
    result = sim.run(specs(100, seed=1, gap_s=0.3, prompt=(100, 800), output=(20, 200)))
    assert len(sim.replicas) > 2, "no replica replaced the dead ones"
    assert any(fr.outcome == COMPLETED for fr in result.requests)


def _replica_seconds(result: FleetResult) -> float:
    """The integral of serving + starting replicas over the run, from its step curve."""
    points = result.replicas_over_time
    assert points[0][0] == 0.0 and points[-1][0] == result.end_s
    return sum((t1 - t0) * (s + b) for (t0, s, b), (t1, _, _) in pairwise(points))


@pytest.mark.parametrize("policy", [ScalingPolicy.FIXED, ScalingPolicy.UTILIZATION, ScalingPolicy.TIER])
def test_replicas_over_time_integrate_to_the_gpu_hours(policy: ScalingPolicy) -> None:
    # A burst then a lull: the fleet grows, loses a replica, and shrinks again (draining).
    burst = specs(300, seed=3, gap_s=0.05, prompt=(500, 2000), output=(50, 200))
    lull = specs(5, seed=4, gap_s=5.0, prompt=(50, 60), output=(5, 9))
    tail = [replace(s, index=300 + i, arrival_s=200.0 + (s.arrival_s or 0.0)) for i, s in enumerate(lull)]
    scaling = AutoscaleConfig(policy, max_replicas=4, startup_delay_s=10.0, interval_s=5.0, idle_s=20.0)
    sim = FleetSim(FleetConfig(2, autoscale=scaling, kills=((12.0, 1),)), build_engine)
    result = sim.run([*burst, *tail])
    assert _replica_seconds(result) * GPUS == pytest.approx(result.gpu_seconds, rel=1e-12)
    assert all(s + b <= max(2, scaling.max_replicas) for _, s, b in result.replicas_over_time)
    if policy is not ScalingPolicy.FIXED:
        assert len(sim.replicas) > 2, "the burst never scaled the fleet out"


def test_a_fleet_that_scales_out_and_in_again_and_again_keeps_scaling_out() -> None:
    # Twelve bursts, each past one replica and each followed by a lull long enough to drain
    # the second: every launch takes a name of its own. The gateway knew a fixed list of
    # 4 x max_replicas names, and from the ninth launch on the fleet silently stayed small.
    bursts = [
        replace(s, index=50 * b + i, arrival_s=60.0 * b + (s.arrival_s or 0.0))
        for b in range(12)
        for i, s in enumerate(specs(50, seed=b, gap_s=0.02, prompt=(500, 1500), output=(100, 300)))
    ]
    scaling = AutoscaleConfig(
        ScalingPolicy.UTILIZATION, max_replicas=2, startup_delay_s=1.0, interval_s=1.0, idle_s=5.0
    )
    sim = FleetSim(FleetConfig(1, autoscale=scaling), build_engine)
    result = sim.run(bursts)
    # A launch shows as a replica more starting than at the point before.
    launched = [t1 for (_, _, b0), (t1, _, b1) in pairwise(result.replicas_over_time) if b1 > b0]
    assert {int(t // 60.0) for t in launched} == set(range(12)), f"scaled out at {launched}"
    assert all(s + b <= 2 for _, s, b in result.replicas_over_time)
