"""Autoscaling: a replica serves only after its start-up delay; tiers decide when to add one."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tierserve.bench.idle import IdleTtft
from tierserve.clock import VirtualClock
from tierserve.fleet.autoscaler import AutoscaleConfig, Autoscaler, Observation, ScalingPolicy
from tierserve.fleet.dispatch import FleetDispatch
from tierserve.fleet.replica import Exported, Replica, ReplicaState
from tierserve.fleet.requests import FleetRequest
from tierserve.fleet.sim import FleetConfig, FleetSim
from tierserve.tiers import Tier
from tierserve.workloads.spec import RequestSpec

from .helpers import CONFIG, build_engine, specs

DELAY_S = 20.0


def test_a_new_replica_serves_only_after_its_startup_delay() -> None:
    workload = specs(500, seed=11, gap_s=0.03, prompt=(500, 3000), output=(100, 300))
    scaling = AutoscaleConfig(ScalingPolicy.TIER, max_replicas=4, startup_delay_s=DELAY_S, interval_s=2.0)
    sim = FleetSim(FleetConfig(1, router="tier-aware", autoscale=scaling), build_engine)
    result = sim.run(workload)
    added = [r for r in sim.replicas.values() if r.name != "replica-0"]
    assert added, "the overloaded fleet never scaled out"
    for replica in added:
        assert replica.ready_s is not None and replica.ready_s - replica.launched_s == DELAY_S
        assert all(t >= replica.ready_s for t in _sends(result.requests, replica.name))
    assert any(_sends(result.requests, r.name) for r in added), "no added replica ever served"
    # The launch counts GPU time from the start of the model load, not from readiness.
    assert (
        result.gpu_seconds
        > sum((result.end_s - r.ready_s) * 8 for r in sim.replicas.values() if r.ready_s is not None) - 1e-6
    )


def test_a_replica_ready_while_the_gateway_holds_a_queue_takes_a_share_of_it_not_all() -> None:
    """The router read a replica never seen full as having no limit: the first added replica
    took the whole queue in the instant it became ready (340 requests, twice what its peer
    runs at once) and the one ready two seconds later got none."""
    workload = specs(700, seed=11, gap_s=0.02, prompt=(500, 3000), output=(100, 300))
    scaling = AutoscaleConfig(ScalingPolicy.TIER, max_replicas=4, startup_delay_s=DELAY_S, interval_s=2.0)
    sim = FleetSim(FleetConfig(1, router="tier-aware", autoscale=scaling), build_engine)
    result = sim.run(workload)
    router = sim.dispatch.router
    seats = max(s.seats for s in router.states if s.seats is not None)
    added = [r for r in sim.replicas.values() if r.name != "replica-0" and r.ready_s is not None]
    served = 0
    for replica in added:
        sends = _sends(result.requests, replica.name)
        # A request of each tier may wait beside its peers' seats' worth of running work.
        assert sum(t == replica.ready_s for t in sends) <= seats + len(Tier) * sim.config.settings.max_waiting
        served += bool(sends)
    assert served >= 2


def _sends(reqs: list[FleetRequest], name: str) -> list[float]:
    """When each request sent to replica `name` was sent there."""
    return [t for fr in reqs for n, t in zip(fr.tried, fr.sent_s, strict=True) if n == name]


def _obs(**kw: object) -> Observation:
    base: dict[str, object] = dict(
        now=0.0,
        num_serving=2,
        num_starting=0,
        utilization=[0.5, 0.5],
        num_waiting=[0, 0],
        p0_queued=0,
        p0_attainment=1.0,
        p0_samples=50,
        kv_usage=[0.5, 0.5],
        token_load=[0.5, 0.5],
    )
    base.update(kw)
    return Observation(**base)  # type: ignore[arg-type]


def test_tier_policy_scales_out_when_p0_is_at_risk_and_utilization_policy_does_not() -> None:
    tier = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER))
    util = Autoscaler(AutoscaleConfig(ScalingPolicy.UTILIZATION))
    fixed = Autoscaler(AutoscaleConfig(ScalingPolicy.FIXED))
    for at_risk in (_obs(p0_queued=3), _obs(p0_attainment=0.5)):
        assert tier.decide(at_risk) == 1
        assert util.decide(at_risk) == 0
        assert fixed.decide(at_risk) == 0
    full = _obs(utilization=[0.95, 0.9], kv_usage=[0.95, 0.9])
    assert util.decide(full) == 1 and tier.decide(full) == 1 and fixed.decide(full) == 0


def test_tier_policy_reads_how_full_the_replicas_are_not_how_busy() -> None:
    """The busy fraction reads a replica with one request decoding as busy as a full one: on
    Azure's conversation trace at 3x (about 16 requests/s) both policies grew a fleet of 1 to
    16 replicas, P1 at 100 % from the second minute on."""
    tier = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER))
    util = Autoscaler(AutoscaleConfig(ScalingPolicy.UTILIZATION))
    busy_not_full = _obs(utilization=[1.0, 1.0], kv_usage=[0.3, 0.2])
    assert util.decide(busy_not_full) == 1 and tier.decide(busy_not_full) == 0
    for full in (
        _obs(kv_usage=[0.95, 0.9]),  # K/V caches nearly full
        _obs(kv_usage=[0.3, 0.2], queued=1),  # the gateway holds a request back
        _obs(kv_usage=[0.3, 0.2], urgent_waiting=[2.0, 2.0]),  # P0-P2 requests wait on the replicas
        _obs(kv_usage=[0.3, 0.2], urgent_waiting=[3.0, 1.0]),
    ):
        assert tier.decide(full) == 1, full
    assert tier.decide(_obs(kv_usage=[0.3, 0.2], urgent_waiting=[2.0, 1.0])) == 0  # arrived mid-step
    # A queue on one replica of two (prefix affinity holding a hot prompt there) does not
    # move to a new replica: counted whole, it launched one every interval.
    assert tier.decide(_obs(kv_usage=[0.3, 0.2], urgent_waiting=[40.0, 0.0])) == 0
    lone = _obs(num_serving=1, utilization=[0.5], num_waiting=[0], kv_usage=[0.3], urgent_waiting=[40.0])
    assert tier.decide(lone) == 1  # a lone replica's queue is the fleet's
    # A replica just ready, not yet scraped, counts as empty for scaling out.
    assert tier.decide(_obs(num_serving=2, kv_usage=[0.95])) == 0


def test_tier_policy_scales_in_only_when_nothing_waits_and_caches_and_compute_are_mostly_idle() -> None:
    """Neither full nor computing much. On 70B over 8 x A100 the caches stay under 25 % used
    even with a queue at the gateway, and scaling in on them alone drained a fleet between
    bursts while its replicas ran prompts 57-75 % of the time (P1 99.8 -> 84 % on the code
    trace at 0.5x). The busy fraction is not the measure either: on Azure's conversation
    trace 8 replicas were 99 % busy computing a few per cent of the tokens they could."""

    def calm_for(**obs_kw: object) -> int:
        a = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER, idle_s=10.0))
        a.decide(_obs(now=0.0, **obs_kw))
        return a.decide(_obs(now=10.0, **obs_kw))

    empty, low = [0.1, 0.2], [0.05, 0.02]
    assert calm_for(token_load=low, kv_usage=empty) == -1
    assert calm_for(utilization=[1.0, 1.0], token_load=low, kv_usage=empty) == -1  # busy, few tokens
    assert calm_for(utilization=[0.7, 0.8], token_load=[0.6, 0.7], kv_usage=empty) == 0  # prompt chunks
    assert calm_for(token_load=low, kv_usage=[0.5, 0.5]) == 0
    assert calm_for(token_load=low, kv_usage=[0.1, 0.1], queued=1) == 1  # held at the gateway: full
    assert calm_for(token_load=low, kv_usage=[0.1, 0.1], num_waiting=[1, 0]) == 0  # a queue all interval
    assert calm_for(token_load=low, kv_usage=[0.1, 0.1], urgent_waiting=[1.0, 1.0]) == 0  # builds at its end
    assert calm_for(token_load=low, kv_usage=[0.1, 0.1], urgent_waiting=[1.0, 0.0]) == -1  # arrived mid-step
    assert calm_for(token_load=low, kv_usage=[0.1]) == 0  # a replica not yet scraped counts as full
    # ... and one not yet read over an interval as busy and full.
    assert calm_for(utilization=[0.1], token_load=[0.05], num_unread=1, kv_usage=empty) == 0
    assert calm_for(utilization=[0.1, 0.1], token_load=[], kv_usage=empty) == 0  # none read
    # Judged on the fleet one replica smaller: 2 at 0.3 would leave 1 at 0.6, over the 0.5
    # target; 4 at 0.3 would leave 3 at 0.4.
    assert calm_for(token_load=[0.3, 0.3], kv_usage=empty) == 0
    four = {"num_serving": 4, "utilization": [0.9] * 4, "kv_usage": [0.1] * 4, "num_waiting": [0] * 4}
    assert calm_for(token_load=[0.3] * 4, **four) == -1
    assert calm_for(token_load=[0.4] * 4, **four) == 0
    # The utilization policy reads the busy fraction alone.
    util = Autoscaler(AutoscaleConfig(ScalingPolicy.UTILIZATION, idle_s=10.0))
    for now in (0.0, 10.0):
        change = util.decide(_obs(now=now, utilization=[0.6, 0.7], token_load=low, kv_usage=empty))
    assert change == 0 and calm_for(utilization=[0.6, 0.7], token_load=low, kv_usage=empty) == -1


def test_p0_attainment_scales_out_only_on_enough_requests_and_not_while_a_replica_loads() -> None:
    """At about 9 P0 requests a minute one miss held the 60 s window under 95 %, and the tier
    policy launched a replica at every tick of it, each while the last still loaded: 13
    replicas where utilization-only scaling launched 8, for the same attainment."""
    tier = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER))
    assert tier.decide(_obs(p0_attainment=0.5, p0_samples=19)) == 0  # too few to judge
    assert tier.decide(_obs(p0_attainment=0.5, p0_samples=20)) == 1
    assert tier.decide(_obs(p0_attainment=0.5, num_starting=1)) == 0  # its remedy is loading
    assert tier.decide(_obs(p0_queued=1, num_starting=1)) == 1  # a P0 queue still acts at once


def test_p0_attainment_scales_out_only_a_fleet_that_is_not_calm() -> None:
    """P0 missing its target while the fleet could do without a replica (little compute
    used, nothing waiting, caches mostly empty) misses it for the step it arrives into: on
    Azure's conversation trace at 3x, two such launches left P0's attainment where it was.
    A P0 queue at the gateway acts whatever the load."""
    tier = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER))
    calm = dict(token_load=[0.05, 0.02], kv_usage=[0.1, 0.2])
    assert tier.decide(_obs(p0_attainment=0.5, **calm)) == 0
    assert tier.decide(_obs(p0_attainment=0.5, **{**calm, "token_load": [0.55, 0.6]})) == 1
    assert tier.decide(_obs(p0_attainment=0.5, **{**calm, "num_waiting": [1, 0]})) == 1  # a queue
    assert tier.decide(_obs(p0_queued=1, **calm)) == 1
    lone = _obs(num_serving=1, utilization=[0.1], num_waiting=[0], token_load=[0.01], kv_usage=[0.1])
    assert tier.decide(replace(lone, p0_attainment=0.5)) == 0
    assert tier.decide(replace(lone, p0_attainment=0.5, token_load=[0.6])) == 1


def test_a_fleet_scaled_in_with_p0_missing_does_not_launch_again_at_the_next_tick() -> None:
    """Room for P0 is judged on the fleet as it stands, scaling in on the fleet one replica
    smaller: judged alike, 3 replicas at 0.3 went to 2 (0.45 each, calm on 3), which then
    read as short of room (0.9 on one) and launched again on P0's misses (a review)."""
    tier = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER, idle_s=0.0))
    quiet = dict(p0_attainment=0.9, kv_usage=[0.1, 0.1, 0.1], num_waiting=[0, 0, 0])
    three = _obs(num_serving=3, utilization=[0.9] * 3, token_load=[0.3] * 3, **quiet)
    assert tier.decide(three) == -1
    two = replace(three, now=15.0, num_serving=2, utilization=[0.9] * 2, token_load=[0.45] * 2)
    assert tier.decide(replace(two, kv_usage=[0.1] * 2, num_waiting=[0, 0])) == 0
    # Down to one: 2 at 0.2 (0.4 on one) scale in, and the one left at 0.4 has room too.
    two = replace(two, now=30.0, token_load=[0.2] * 2, kv_usage=[0.1] * 2, num_waiting=[0, 0])
    assert tier.decide(two) == -1
    one = replace(two, now=45.0, num_serving=1, utilization=[0.9], token_load=[0.4], kv_usage=[0.1])
    assert tier.decide(replace(one, num_waiting=[0])) == 0


def test_p0_attainment_counts_only_the_requests_since_the_fleet_last_grew() -> None:
    """Misses from before the newest replica was ready say nothing of the fleet as it is."""
    from tierserve.fleet.observe import FleetObserver
    from tierserve.workloads.spec import RequestSpec

    clock = VirtualClock()
    observer = FleetObserver(clock, CONFIG)
    for i, (t, ttft_s) in enumerate([(1.0, 2.0), (2.0, 2.0), (10.0, 0.1), (11.0, 0.1), (12.0, 2.0)]):
        clock.advance_to(t)
        fr = FleetRequest(i, RequestSpec(i, Tier.P0, "t", (1, 2), 1, arrival_s=t), t)
        fr.first_token_s = t + ttft_s
        observer.first_token(fr)
    assert observer.p0_attainment() == (2 / 5, 5)
    assert observer.p0_attainment(since=10.0) == (2 / 3, 3)
    assert observer.p0_attainment(since=20.0) == (None, 0)
    clock.advance_to(69.0)  # the window (60 s) has let the first two go
    assert observer.p0_attainment() == (2 / 3, 3)


def test_scale_out_respects_the_maximum_and_loads_at_most_max_starting_at_once() -> None:
    a = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER, max_replicas=3, max_starting=1))
    assert a.decide(_obs(p0_queued=1, num_serving=2, num_starting=1)) == 0
    assert a.decide(_obs(p0_queued=1, num_serving=3)) == 0
    assert a.decide(_obs(p0_queued=1, num_serving=2)) == 1


def test_scale_in_only_after_idle_long_enough_and_never_below_the_minimum() -> None:
    a = Autoscaler(AutoscaleConfig(ScalingPolicy.UTILIZATION, min_replicas=1, idle_s=100.0))
    calm = [0.1, 0.1]
    assert a.decide(_obs(now=0.0, utilization=calm)) == 0
    assert a.decide(_obs(now=50.0, utilization=calm)) == 0
    assert a.decide(_obs(now=100.0, utilization=calm)) == -1
    assert a.decide(_obs(now=150.0, utilization=calm)) == 0  # a new idle period starts
    single = Autoscaler(AutoscaleConfig(ScalingPolicy.UTILIZATION, min_replicas=1, idle_s=0.0))
    assert single.decide(_obs(num_serving=1, utilization=[0.0])) == 0


def test_a_drained_replica_stops_and_takes_no_new_requests() -> None:
    workload = specs(200, seed=5, gap_s=0.5, prompt=(50, 500), output=(5, 50))
    scaling = AutoscaleConfig(ScalingPolicy.UTILIZATION, min_replicas=1, idle_s=10.0, interval_s=2.0)
    sim = FleetSim(FleetConfig(3, router="least-loaded", autoscale=scaling), build_engine)
    result = sim.run(workload)
    stopped = [r for r in sim.replicas.values() if r.state is ReplicaState.STOPPED]
    assert stopped
    for r in stopped:
        assert r.ended_s is not None
        assert max(_sends(result.requests, r.name), default=0.0) <= r.ended_s
        assert not r.engine.has_unfinished()
    assert all(fr.outcome == "completed" for fr in result.requests)


def test_p0_prompts_too_long_to_meet_the_target_even_alone_do_not_scale_the_fleet_out() -> None:
    """Counted, P0 requests whose prompt alone takes longer than P0's target held P0's
    attainment under the tier policy's floor at any fleet size: a light load of such
    prompts scaled the fleet out to its maximum (Azure's conversation trace has ~8 % of
    them). Without `alone_s` they count, and the same fleet scales out."""
    workload = specs(60, seed=3, gap_s=3.0, prompt=(6000, 7000), output=(10, 30))
    # About 20 P0 requests a minute: a smaller sample than the default asks for.
    scaling = AutoscaleConfig(
        ScalingPolicy.TIER, max_replicas=4, startup_delay_s=5.0, interval_s=5.0, p0_min_samples=5
    )
    alone = IdleTtft(CONFIG, build_engine(VirtualClock()).executor)
    assert alone(6000, 0) > CONFIG.tier(Tier.P0).ttft_target_s  # too long to attain alone
    judged = FleetSim(FleetConfig(1, router="tier-aware", autoscale=scaling), build_engine, alone)
    judged.run(workload)
    counted = FleetSim(FleetConfig(1, router="tier-aware", autoscale=scaling), build_engine)
    counted.run(workload)
    assert len(judged.replicas) == 1
    assert len(counted.replicas) > 1


def test_the_longest_p0_prompt_within_the_target_alone_is_found_in_few_idle_runs() -> None:
    """One idle run per P0 prompt length cost seconds on a trace's thousands of lengths; a
    TTFT alone grows with the prompt, so the observer finds the longest within P0's target
    once (per cached history) and compares."""
    from tierserve.fleet.observe import FleetObserver
    from tierserve.workloads.spec import RequestSpec

    idle = IdleTtft(CONFIG, build_engine(VirtualClock()).executor)
    calls: list[int] = []

    def alone(num_prompt_tokens: int, num_history_tokens: int) -> float:
        calls.append(num_prompt_tokens)
        return idle(num_prompt_tokens, num_history_tokens)

    observer = FleetObserver(VirtualClock(), CONFIG, alone_s=alone)
    target = CONFIG.tier(Tier.P0).ttft_target_s
    lengths = range(100, 8000, 7)
    for i, n in enumerate(lengths):
        fr = FleetRequest(i, RequestSpec(i, Tier.P0, "t", tuple(range(n)), 1, arrival_s=0.0), 0.0)
        fr.first_token_s = 10.0  # a miss: counted only where the prompt alone meets the target
        observer.first_token(fr)
    counted = sum(1 for n in lengths if idle(n, 0) <= target)
    assert 0 < counted < len(lengths)  # some fit alone, some do not
    assert observer.p0_attainment() == (0.0, counted)
    assert len(calls) < 40


def test_a_replica_busy_from_the_moment_it_is_ready_reads_fully_busy() -> None:
    """The busy fraction was read from the replica's launch: one ready at 50 s and busy
    through the next 15 s read 0.23, its model loading counted as idle time."""
    replica = Replica("r", build_engine, launched_s=0.0)
    replica.make_ready(50.0)
    replica.exported = Exported(busy_s=15.0)
    replica.observe_busy(65.0)
    assert replica.utilization == 1.0


def test_the_token_load_is_tokens_a_second_as_a_share_of_full_prompt_steps() -> None:
    replica = Replica("r", build_engine, launched_s=0.0)
    engine = replica.engine
    budget = engine.config.scheduler.max_num_batched_tokens
    assert replica.token_capacity == pytest.approx(budget / engine.executor.estimate_prefill_s(budget))
    replica.make_ready(0.0)
    replica.exported = Exported(busy_s=10.0, num_tokens=int(replica.token_capacity * 2.5))
    replica.observe_busy(10.0)
    assert replica.token_load == pytest.approx(0.25, rel=1e-3)


def test_nothing_is_scaled_in_before_a_busy_fraction_has_been_read() -> None:
    """At the first tick no interval had passed: every replica read 0 % busy, and with no
    idle time asked for, the fleet drained one at t = 0 and launched it again later."""
    calm_at_once = Autoscaler(AutoscaleConfig(ScalingPolicy.UTILIZATION, min_replicas=1, idle_s=0.0))
    assert calm_at_once.decide(_obs(num_serving=3, utilization=[], num_waiting=[0, 0, 0], num_unread=3)) == 0
    assert calm_at_once.decide(_obs(num_serving=3, utilization=[0.1, 0.1, 0.1], num_waiting=[0, 0, 0])) < 0
    workload = specs(300, seed=3, gap_s=0.05, prompt=(200, 1000), output=(20, 100))
    scaling = AutoscaleConfig(
        ScalingPolicy.UTILIZATION, min_replicas=1, max_replicas=3, idle_s=0.0, startup_delay_s=DELAY_S
    )
    sim = FleetSim(FleetConfig(3, router="tier-aware", autoscale=scaling), build_engine)
    sim.run(workload)
    assert all(r.ended_s is None or r.ended_s > 0 for r in sim.replicas.values())


def test_a_replica_ready_at_the_tick_counts_as_idle_for_scaling_out_and_busy_for_scaling_in() -> None:
    """A replica that became ready at the very tick was left out of the mean: the two old,
    fully busy replicas read 100 %, and a fourth was launched in the instant capacity came."""
    util = Autoscaler(AutoscaleConfig(ScalingPolicy.UTILIZATION, min_replicas=1, idle_s=0.0))
    assert util.decide(_obs(num_serving=3, utilization=[1.0, 1.0], num_waiting=[0] * 3, num_unread=1)) == 0
    assert util.decide(_obs(num_serving=3, utilization=[1.0, 1.0, 1.0], num_waiting=[0] * 3)) == 1
    # Two replicas 30 % busy beside one just ready: not calm yet (0.53, over the 0.4 bar).
    assert util.decide(_obs(num_serving=3, utilization=[0.3, 0.3], num_waiting=[0] * 3, num_unread=1)) == 0
    assert util.decide(_obs(num_serving=3, utilization=[0.3, 0.3, 0.3], num_waiting=[0] * 3)) == -1


def test_the_tier_policy_judges_p0_on_the_requests_since_its_newest_replica_was_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fleet asks the observer for P0's attainment since the newest serving replica
    became ready: counted from the whole window, misses from before a scale-out launched
    the next replica (13 where utilization-only scaling launched 8)."""
    from tierserve.fleet.observe import FleetObserver

    asked: list[tuple[float, float]] = []  # (now, since)
    real = FleetObserver.p0_attainment

    def recording(self: FleetObserver, since: float = -math.inf) -> tuple[float | None, int]:
        asked.append((self._clock.now(), since))
        return real(self, since)

    monkeypatch.setattr(FleetObserver, "p0_attainment", recording)
    workload = specs(500, seed=11, gap_s=0.03, prompt=(500, 3000), output=(100, 300))
    scaling = AutoscaleConfig(ScalingPolicy.TIER, max_replicas=4, startup_delay_s=DELAY_S, interval_s=2.0)
    sim = FleetSim(FleetConfig(1, router="tier-aware", autoscale=scaling), build_engine)
    sim.run(workload)
    readies = sorted(r.ready_s for r in sim.replicas.values() if r.ready_s is not None)
    assert len(readies) > 1, "the fleet never scaled out"
    for now, since in asked:
        assert since == max(t for t in readies if t <= now)


CALM: dict[str, object] = {"utilization": [0.1, 0.1], "kv_usage": [0.1, 0.1], "token_load": [0.05, 0.05]}


def test_max_starting_alone_holds_a_launch() -> None:
    a = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER, max_replicas=8, max_starting=1))
    assert a.decide(_obs(p0_queued=1, num_serving=2, num_starting=1)) == 0
    assert a.decide(_obs(p0_queued=1, num_serving=2, num_starting=0)) == 1


def test_no_scale_in_while_a_replica_loads() -> None:
    a = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER, idle_s=10.0))
    a.decide(_obs(now=0.0, num_starting=1, **CALM))
    assert a.decide(_obs(now=10.0, num_starting=1, **CALM)) == 0


def test_the_calm_timer_restarts_after_a_busy_or_full_tick() -> None:
    interrupts: list[dict[str, object]] = [
        {"utilization": [0.1, 0.1], "kv_usage": [0.5, 0.5]},  # not calm
        {"kv_usage": [0.1, 0.1], "queued": 1},  # full: wants more
    ]
    for interrupt in interrupts:
        a = Autoscaler(AutoscaleConfig(ScalingPolicy.TIER, idle_s=10.0))
        assert a.decide(_obs(now=0.0, **CALM)) == 0
        a.decide(_obs(now=5.0, **{**CALM, **interrupt}))
        assert a.decide(_obs(now=10.0, **CALM)) == 0  # calm since 10 s, not 0 s
        assert a.decide(_obs(now=20.0, **CALM)) == -1


def _observations(monkeypatch: pytest.MonkeyPatch, workload: list[RequestSpec]) -> list[Observation]:
    """Every observation the fleet hands a tier autoscaler over `workload` on one replica."""
    seen: list[Observation] = []
    decide = Autoscaler.decide

    def recording(self: Autoscaler, obs: Observation) -> int:
        seen.append(obs)
        return decide(self, obs)

    monkeypatch.setattr(Autoscaler, "decide", recording)
    scaling = AutoscaleConfig(ScalingPolicy.TIER, max_replicas=2, startup_delay_s=20.0, interval_s=2.0)
    FleetSim(FleetConfig(1, router="tier-aware", autoscale=scaling), build_engine).run(workload)
    return seen


def test_the_fleet_hands_the_tier_autoscaler_its_fullness_signals(monkeypatch: pytest.MonkeyPatch) -> None:
    """The autoscaler's rules are tested on observations made by hand; this checks the fleet
    fills them in (a review found that zeroing any of them failed no test)."""
    seen = _observations(monkeypatch, specs(500, seed=11, gap_s=0.03, prompt=(500, 3000), output=(100, 300)))
    assert any(o.queued > 0 for o in seen)
    assert any(sum(o.urgent_waiting) > 0 for o in seen)
    assert any(u > 0 for o in seen for u in o.kv_usage)
    assert any(load > 0 for o in seen for load in o.token_load)


def test_the_autoscaler_reads_the_fewest_waiting_any_scrape_found_since_its_last_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that arrived during a step waits for it, so one scrape reads some waiting
    under any steady traffic, and the tier policy never scaled in an over-provisioned fleet."""
    events: list[tuple[str, object]] = []
    note, decide = Replica.note_waiting, Autoscaler.decide

    def noting(self: Replica, num_waiting: int) -> None:
        events.append(("scrape", num_waiting))
        note(self, num_waiting)

    def deciding(self: Autoscaler, obs: Observation) -> int:
        events.append(("tick", list(obs.num_waiting)))
        return decide(self, obs)

    monkeypatch.setattr(Replica, "note_waiting", noting)
    monkeypatch.setattr(Autoscaler, "decide", deciding)
    scaling = AutoscaleConfig(ScalingPolicy.TIER, max_replicas=1, interval_s=2.0)
    workload = specs(400, seed=5, gap_s=0.02, prompt=(200, 2000), output=(20, 200))
    FleetSim(FleetConfig(1, router="tier-aware", autoscale=scaling), build_engine).run(workload)
    scraped: list[int] = []
    checked = differs = 0
    for kind, value in events:
        if kind == "scrape":
            assert isinstance(value, int)
            scraped.append(value)
        elif scraped:
            assert value == [min(scraped)]
            checked += 1
            differs += min(scraped) < scraped[-1]
            scraped = []
    assert checked >= 3 and differs >= 1  # some interval ended with a queue that came and went


def test_p3_requests_waiting_on_a_replica_or_at_the_gateway_are_not_urgent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Background work buys no GPUs: under the tier-aware router P3-only traffic at 4x,
    held at the gateway, bought 6 replicas where round-robin kept 2."""
    held: list[int] = []
    depth = FleetDispatch.depth

    def recording(self: FleetDispatch, tier: Tier | None = None) -> int:
        held.append(depth(self, Tier.P3))  # as the autoscaler reads the queue
        return depth(self, tier)

    monkeypatch.setattr(FleetDispatch, "depth", recording)
    workload = specs(800, seed=11, gap_s=0.01, prompt=(500, 3000), output=(100, 300))
    seen = _observations(monkeypatch, [replace(s, tier=Tier.P3) for s in workload])
    assert any(sum(o.num_waiting) > 0 for o in seen)
    assert all(sum(o.urgent_waiting) == 0 for o in seen)
    assert all(o.queued == 0 for o in seen)
    assert max(held, default=0) > 0, "the gateway never held a P3 request back"
