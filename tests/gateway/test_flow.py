"""Flow control on a virtual clock: the policy's order, caps, waits and retry_after."""

from __future__ import annotations

import pytest

from tierserve.clock import VirtualClock
from tierserve.config import DEFAULT_TIERS, EngineConfig, TierConfig
from tierserve.gateway.flow import DEFAULT_RETRY_S, FlowControl, Refusal
from tierserve.request import Request
from tierserve.tiers import ALL_TIERS, Tier

CAPS = {Tier.P0: 4, Tier.P1: 4, Tier.P2: 4, Tier.P3: 4}
WAITS = {Tier.P0: 1.0, Tier.P1: 5.0, Tier.P2: 30.0, Tier.P3: 60.0}


def _flow(policy: str = "hybrid", config: EngineConfig | None = None) -> tuple[FlowControl, VirtualClock]:
    clock = VirtualClock()
    return FlowControl(config or EngineConfig(), policy, CAPS, WAITS, clock), clock


def _ticket(flow: FlowControl, tier: Tier, tenant: str = "t") -> Request:
    t = flow.offer(tier, tenant)
    assert isinstance(t, Request)
    return t


def _drain(flow: FlowControl) -> list[Request]:
    out = []
    while (t := flow.release()) is not None:
        out.append(t)
    return out


def test_hybrid_releases_p0_first_then_the_fair_tiers() -> None:
    flow, clock = _flow()
    order = [Tier.P3, Tier.P2, Tier.P1, Tier.P0, Tier.P2, Tier.P0]
    for tier in order:
        _ticket(flow, tier)
        clock.elapse(0.01)
    released = [t.tier for t in _drain(flow)]
    assert released[:2] == [Tier.P0, Tier.P0]
    assert released.index(Tier.P3) > released.index(Tier.P1)  # best effort: not while a P1 waits
    assert sorted(released) == sorted(order)


def test_aging_lets_an_old_p2_out_ahead_of_a_newer_p1() -> None:
    tiers = dict(DEFAULT_TIERS)
    tiers[Tier.P2] = TierConfig(**{**DEFAULT_TIERS[Tier.P2].__dict__, "aging_s": 2.0})
    flow, clock = _flow(config=EngineConfig(tiers=tiers))
    old = _ticket(flow, Tier.P2)
    clock.elapse(3.0)
    for _ in range(3):
        _ticket(flow, Tier.P1)
    assert flow.release() is old


def test_a_full_tier_is_refused_with_retry_after_from_the_drain_rate() -> None:
    flow, clock = _flow()
    for _ in range(CAPS[Tier.P1]):
        _ticket(flow, Tier.P1)
    refused = flow.offer(Tier.P1, "t")
    # No rate known yet, nothing finished in 10 s: as long as P1 may wait, not a steady 1 s
    # (clients of a fleet whose answers take longer than that retried every second).
    assert isinstance(refused, Refusal) and refused.retry_after_s == WAITS[Tier.P1]
    assert isinstance(flow.offer(Tier.P2, "t"), Request)  # other tiers have their own cap
    for _ in range(20):  # the fleet finishes 10 requests a second
        clock.elapse(0.1)
        flow.drained()
    refused = flow.offer(Tier.P1, "t")
    assert isinstance(refused, Refusal)
    # 4 P1 waiting (the P2 is not ahead of a P1) + this one, at ~10/s
    assert refused.retry_after_s == pytest.approx(0.5, rel=0.1)


def test_requests_past_their_tiers_wait_are_expired_and_cancel_removes() -> None:
    flow, clock = _flow()
    p0 = _ticket(flow, Tier.P0)
    p1 = _ticket(flow, Tier.P1)
    gone = _ticket(flow, Tier.P2)
    flow.cancel(gone)
    clock.elapse(2.0)
    assert flow.expire() == [p0]
    assert flow.depth(Tier.P0) == 0 and flow.depth(Tier.P1) == 1
    clock.elapse(4.0)
    assert flow.expire() == [p1]
    assert len(flow) == 0 and flow.release() is None


def test_peek_and_release_at_the_same_time_agree_for_every_policy() -> None:
    from tierserve.scheduling import POLICIES

    for name in POLICIES:
        flow, clock = _flow(name)
        for i, tier in enumerate(ALL_TIERS * 2):
            _ticket(flow, tier, tenant=f"t{i % 3}")
            clock.elapse(0.5)
        while len(flow):
            now = clock.now()
            head = flow.peek(now)
            assert flow.release(now) is head


def test_expiry_takes_the_late_tickets_without_walking_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue at its caps under a timeout storm: `expire` runs at every boundary, so it
    must cost the tickets that leave, not the tickets that wait."""
    caps = dict.fromkeys(ALL_TIERS, 10_000)
    clock = VirtualClock()
    flow = FlowControl(EngineConfig(), "hybrid", caps, {**WAITS, Tier.P3: float("inf")}, clock)
    tickets: dict[Tier, list[Request]] = {tier: [] for tier in ALL_TIERS}
    for i in range(400):
        for tier in ALL_TIERS:
            tickets[tier].append(_ticket(flow, tier, tenant=f"t{i % 7}"))
        clock.elapse(0.01)
    released = [flow.release() for _ in range(30)]  # P0's oldest go first
    flow.cancel(tickets[Tier.P1][5])
    walked = lambda self: pytest.fail("expire walked the queue")  # noqa: E731
    monkeypatch.setattr(type(flow._queues[""]), "__iter__", walked)

    clock.elapse(0.5)  # 4.5 s since the first tickets: P0's wait (1 s) is over for the older
    late = flow.expire()
    assert late and all(t.tier is Tier.P0 for t in late)
    assert late == [t for t in tickets[Tier.P0] if t not in released and clock.now() - t.arrival_time > 1.0]
    assert flow.depth(Tier.P0) == 400 - 30 - len(late) > 0  # the newer P0 tickets still wait
    clock.elapse(4.0)  # P1's 5 s: the older P1 tickets are late too, never the cancelled one
    late = flow.expire()
    p1_late = [t for t in late if t.tier is Tier.P1]
    assert p1_late and tickets[Tier.P1][5] not in p1_late
    assert [t.arrival_time for t in p1_late] == sorted(t.arrival_time for t in p1_late)
    clock.elapse(1e6)  # P3 has no cap on its wait: it stays
    flow.expire()
    assert flow.depth() == flow.depth(Tier.P3) == 400


def test_retry_after_while_few_requests_finish_prices_the_queue_at_that_rate() -> None:
    flow, clock = _flow()
    for _ in range(CAPS[Tier.P3]):
        _ticket(flow, Tier.P3)
    for _ in range(5):  # 5 finished in the 10 s window: under the 8 a measured rate needs
        clock.elapse(1.0)
        flow.drained()
    refused = flow.offer(Tier.P3, "t")
    assert isinstance(refused, Refusal)
    assert refused.retry_after_s == pytest.approx(5 / (5 / 10))  # 4 waiting + this one at 0.5/s
    # Never under the floor, and the measured rate takes over once known.
    flow2, clock2 = _flow()
    for _ in range(CAPS[Tier.P0]):
        _ticket(flow2, Tier.P0)
    for _ in range(7):
        clock2.elapse(0.01)
        flow2.drained()
    refused = flow2.offer(Tier.P0, "t")
    # 5 ahead at 0.7/s is 7 s, capped at P0's 1 s wait: the floor.
    assert isinstance(refused, Refusal) and refused.retry_after_s == DEFAULT_RETRY_S


def test_each_model_queues_behind_its_own_requests_only() -> None:
    """One queue for every model held a model whose upstreams sat idle behind another's
    backlog (P0 included, until the backlog drained or it timed out)."""
    flow, _ = _flow()
    for _ in range(3):
        flow.offer(Tier.P1, "t", model="big")
    assert flow.depth_upto(Tier.P3, "big") == 3 and flow.depth_upto(Tier.P3, "small") == 0
    small = flow.offer(Tier.P3, "t", model="small")
    assert isinstance(small, Request) and flow.model_of(small) == "small"
    # Caps are per model: "big"'s full P1 queue refuses none of "small"'s.
    for _ in range(CAPS[Tier.P1] - 3):
        flow.offer(Tier.P1, "t", model="big")
    assert isinstance(flow.offer(Tier.P1, "t", model="big"), Refusal)
    assert isinstance(flow.offer(Tier.P1, "t", model="small"), Request)
    # "big" has no room: set aside, "small"'s requests are released past it, P1 first.
    flow.set_aside(Tier.P1, "big")
    released = [flow.release(), flow.release()]
    assert [t.tier for t in released] == [Tier.P1, Tier.P3]
    assert flow.release() is None  # "big"'s wait for room
    flow.end_pass()
    assert flow.release() is not None and flow.depth(model="big") == CAPS[Tier.P1] - 1
    assert len(flow) == CAPS[Tier.P1] - 1


def test_a_retried_request_keeps_its_place_and_the_wait_it_has_left() -> None:
    flow, clock = _flow()
    clock.elapse(3.0)
    later = _ticket(flow, Tier.P1)
    # Queued at 0.1, released at 2.9, its attempt failed at 3.0: 2.8 s waited before.
    retried = flow.offer(Tier.P1, "t", waited_s=2.8)
    assert isinstance(retried, Request)
    assert flow.release() is retried and flow.release() is later
    again = flow.offer(Tier.P1, "t", waited_s=2.8)
    assert isinstance(again, Request) and flow.waited(again) == pytest.approx(2.8)
    clock.elapse(WAITS[Tier.P1] - 2.8 + 0.01)  # past P1's 5 s in all, not 5 s more
    assert flow.expire() == [again]
