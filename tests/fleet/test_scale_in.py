"""Scaling in: once calm for the idle period, to the size the load needs in one decision.

One replica an idle period, a burst that grew the fleet to 16 took 15 periods of 300 s to
scale back in, and `bench fleet --autoscale` charged the autoscaled fleets for replicas the
load no longer needed (Kubernetes' autoscaler scales to ceil(n * load / target) once its
stabilization window has held)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from tierserve.fleet.autoscaler import AutoscaleConfig, Autoscaler, Observation, ScalingPolicy
from tierserve.fleet.replica import Replica
from tierserve.fleet.requests import FleetRequest
from tierserve.fleet.sim import FleetConfig, FleetSim

from .helpers import build_engine, specs

SIXTEEN = 16


def _calm(num_serving: int = SIXTEEN, /, **kw: object) -> Observation:
    """A fleet with nothing waiting anywhere, each replica at the given loads."""
    load = {"utilization": 0.12, "token_load": 0.05, "kv_usage": 0.02}
    load.update({k: v for k, v in kw.items() if k in load})  # type: ignore[misc]
    rest = {k: v for k, v in kw.items() if k not in load}
    base: dict[str, object] = dict(
        now=0.0,
        num_serving=num_serving,
        num_starting=0,
        num_waiting=[0] * num_serving,
        p0_queued=0,
        p0_attainment=1.0,
        p0_samples=50,
        **{k: [v] * num_serving for k, v in load.items()},
    )
    base.update(rest)
    return Observation(**base)  # type: ignore[arg-type]


def _after_window(a: Autoscaler, obs: Observation, idle_s: float = 300.0) -> list[int]:
    """Its decisions at every 15 s tick of one idle period, `obs` at each."""
    return [a.decide(replace(obs, now=t)) for t in range(0, int(idle_s) + 1, 15)]


@pytest.mark.parametrize(
    ("policy", "loads", "keep"),
    [
        # Token load 16 x 0.05 = 0.8: 2 replicas carry it at 0.4, under 0.5; 1 would not.
        (ScalingPolicy.TIER, {}, 2),
        # The caches too: 16 x 0.2 = 3.2 caches' worth needs 9 under 40 % each.
        (ScalingPolicy.TIER, {"kv_usage": 0.2}, 9),
        # Busy 16 x 0.12 = 1.92 replicas' time: ceil(1.92 / 0.4) = 5.
        (ScalingPolicy.UTILIZATION, {}, 5),
    ],
)
def test_a_fleet_idle_for_the_window_scales_in_to_what_the_load_needs_in_one_decision(
    policy: ScalingPolicy, loads: dict[str, float], keep: int
) -> None:
    a = Autoscaler(AutoscaleConfig(policy, idle_s=300.0))
    decisions = _after_window(a, _calm(**loads))
    assert decisions == [0] * 20 + [keep - SIXTEEN]
    assert a.decide(_calm(keep, now=315.0, **loads)) == 0  # the next waits for a new period


def test_scale_in_stops_at_the_minimum() -> None:
    for policy in (ScalingPolicy.TIER, ScalingPolicy.UTILIZATION):
        a = Autoscaler(AutoscaleConfig(policy, min_replicas=6, idle_s=300.0))
        assert _after_window(a, _calm(token_load=0.0, kv_usage=0.0, utilization=0.0))[-1] == 6 - SIXTEEN


def test_scale_in_sizes_the_fleet_for_the_busiest_tick_of_the_window() -> None:
    """As Kubernetes' stabilization window takes its highest recommendation: a lull in the
    last interval does not size the fleet for the whole period's load."""
    a = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER, idle_s=300.0))
    assert a.decide(_calm(now=0.0, token_load=0.1)) == 0  # 1.6 tokens' worth: 4 carry it at 0.4
    assert a.decide(_calm(now=150.0, token_load=0.01)) == 0
    assert a.decide(_calm(now=300.0, token_load=0.01)) == 4 - SIXTEEN


def test_a_calm_fleet_still_scales_in_by_one_where_the_sizing_would_keep_it_whole() -> None:
    """The calm gate's rule for one replica stands as before: 2 replicas 38 % busy share
    0.76 of a replica's time, which one carries over the 0.4 target, but the gate judged
    their mean, under 0.4, and removed one."""
    a = Autoscaler(AutoscaleConfig(ScalingPolicy.UTILIZATION, idle_s=0.0))
    assert a.decide(_calm(2, utilization=0.38)) == -1


def test_a_burst_scaled_in_at_once_loses_and_double_counts_no_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fleet grown by a burst, then under light traffic for longer than the idle period,
    drains more than one replica at one tick, never below its minimum; a drained replica
    holding a request finishes it, and every request ends once."""
    burst = specs(400, seed=11, gap_s=0.03, prompt=(500, 3000), output=(100, 300))
    tail = specs(60, seed=12, gap_s=2.0, prompt=(50, 200), output=(300, 600))
    last = burst[-1].arrival_s or 0.0
    tail = [
        replace(s, index=len(burst) + i, arrival_s=last + (s.arrival_s or 0.0)) for i, s in enumerate(tail)
    ]
    drained: list[tuple[float, str, list[int]]] = []  # when, which, the requests it held
    ends: Counter[int] = Counter()
    drain, finish = FleetSim._drain, FleetRequest.end

    def draining(self: FleetSim, replica: Replica) -> None:
        held = [fr.key for fr in self._live.values() if fr.tried[-1] == replica.name]
        drained.append((self.clock.now(), replica.name, held))
        drain(self, replica)

    def ending(self: FleetRequest, outcome: str, now: float) -> None:
        ends[self.key] += 1
        finish(self, outcome, now)

    monkeypatch.setattr(FleetSim, "_drain", draining)
    monkeypatch.setattr(FleetRequest, "end", ending)
    scaling = AutoscaleConfig(
        ScalingPolicy.TIER, min_replicas=2, max_replicas=6, startup_delay_s=20.0, interval_s=2.0, idle_s=30.0
    )
    sim = FleetSim(FleetConfig(2, router="tier-aware", autoscale=scaling), build_engine)
    result = sim.run(burst + tail)
    at_once = Counter(when for when, _, _ in drained)
    assert max(at_once.values()) >= 2, f"one replica at a time: {drained}"
    assert min(serving + starting for _, serving, starting in result.replicas_over_time) >= 2
    held = [key for _, _, keys in drained for key in keys]
    assert held, "no drained replica held a request"
    for when, name, keys in drained:
        for key in keys:
            fr = result.requests[key]
            assert fr.outcome == "completed" and fr.tried[-1] == name and (fr.finish_s or 0.0) > when
    assert sorted(ends) == list(range(len(burst) + len(tail))) and set(ends.values()) == {1}
    assert not {fr.outcome for fr in result.requests} - {"completed", "refused:queue_timeout"}
