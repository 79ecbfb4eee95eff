"""A replica dies mid-run: its requests are retried (no token yet) or lost (mid stream), none vanish."""

from __future__ import annotations

from tierserve.fleet.replica import ReplicaState
from tierserve.fleet.requests import COMPLETED, LOST, UNFINISHED
from tierserve.fleet.sim import FleetConfig, FleetSim

from .helpers import build_engine, specs

KILL_S = 6.0


def _run(router: str) -> FleetSim:
    workload = specs(300, seed=7, gap_s=0.04, prompt=(200, 3000), output=(100, 400))
    sim = FleetSim(FleetConfig(3, router=router, kills=((KILL_S, 1),)), build_engine)
    sim.run(workload)
    return sim


def test_a_dead_replicas_requests_are_all_accounted_for() -> None:
    for router in ("least-loaded", "tier-aware"):
        sim = _run(router)
        reqs = sim.requests
        assert sim.replicas["replica-1"].state is ReplicaState.DEAD
        assert all(fr.outcome not in (None, UNFINISHED) for fr in reqs)
        assert len(reqs) == 300
        on_dead = [fr for fr in reqs if "replica-1" in fr.tried and fr.tried[-1] == "replica-1"]
        moved = [fr for fr in reqs if fr.tried[:-1].count("replica-1")]
        lost = [fr for fr in reqs if fr.outcome == LOST]
        # Lost: it had a token from replica-1 before it died, and was not sent anywhere else.
        assert lost and all(fr.tried[-1] == "replica-1" and fr.first_token_s <= KILL_S for fr in lost)
        # Retried: no token yet when replica-1 died; it went on to another replica.
        assert moved and all(fr.tried[-1] != "replica-1" and fr.num_retries >= 1 for fr in moved)
        assert all(fr.outcome == COMPLETED for fr in moved)
        # Whatever ended on the dead replica ended there before it died, or was lost.
        assert all(fr.outcome == LOST or fr.finish_s <= KILL_S for fr in on_dead)
        assert not any(fr.outcome == LOST and fr.first_token_s is None for fr in reqs)


def test_no_request_goes_to_a_dead_replica() -> None:
    sim = _run("round-robin")
    assert any("replica-1" in fr.tried for fr in sim.requests)
    sent_after = [fr for fr in sim.requests if fr.arrival_s > KILL_S and "replica-1" in fr.tried]
    assert not sent_after


def test_a_request_the_step_in_flight_would_have_ended_is_lost_with_its_replica() -> None:
    workload = specs(60, seed=2, gap_s=0.1, prompt=(100, 800), output=(20, 60))
    calm = FleetSim(FleetConfig(2, router="round-robin"), build_engine)
    calm.run(workload)
    victim = next(
        fr
        for fr in calm.requests
        if fr.tried == ["replica-1"]
        and fr.first_token_s is not None
        and fr.first_token_s < fr.finish_s - 1e-3
    )
    kill_s = victim.finish_s - 1e-6  # the step that would end it is in flight
    sim = FleetSim(FleetConfig(2, router="round-robin", kills=((kill_s, 1),)), build_engine)
    sim.run(workload)
    assert sim.requests[victim.key].outcome == LOST
    assert all(fr.outcome not in (None, UNFINISHED) for fr in sim.requests)


def test_the_result_says_what_each_kill_did() -> None:
    """A kill of a replica not yet launched, dead already or after the run's end does nothing;
    the report listed the kills asked for as if each had hit."""
    from tierserve.fleet.summary import summarize

    from .helpers import CONFIG

    workload = specs(40, seed=5, gap_s=0.1, prompt=(100, 400), output=(5, 20))
    kills = ((2.0, 1), (3.0, 1), (1.0, 5), (1e9, 0), (2.0, 1))
    sim = FleetSim(FleetConfig(2, router="round-robin", kills=kills), build_engine)
    result = sim.run(workload)
    assert result.faults == [  # in the order they fired (sorted, "already dead" came first)
        (1.0, 5, "not launched"),
        (2.0, 1, "killed"),
        (2.0, 1, "already dead"),
        (3.0, 1, "already dead"),
        (1e9, 0, "after the end"),
    ]
    assert summarize(result, CONFIG, 60.0)["faults"][1] == [2.0, 1, "killed"]


def test_the_progress_callback_counts_each_request_once_as_it_ends() -> None:
    """The bench's bar counts requests ended, whatever their outcome (lost to the dead
    replica, answered, cut at the drain timeout): counted on arrivals, it read 100 % while
    the drain was still to run."""
    workload = specs(300, seed=7, gap_s=0.04, prompt=(200, 3000), output=(100, 400))
    sim = FleetSim(
        FleetConfig(3, router="least-loaded", kills=((KILL_S, 1),), drain_timeout_s=15.0), build_engine
    )
    ended_when_called: list[int] = []
    sim.on_end = lambda: ended_when_called.append(sum(fr.outcome is not None for fr in sim.requests))
    sim.run(workload)
    assert ended_when_called == list(range(1, 301))
    outcomes = {fr.outcome for fr in sim.requests}
    assert {LOST, COMPLETED, UNFINISHED} <= outcomes
