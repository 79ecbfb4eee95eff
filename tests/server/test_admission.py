from __future__ import annotations

import pytest

from tierserve.config import DEFAULT_TIERS
from tierserve.server.admission import AdmissionController, ThroughputMeter
from tierserve.tiers import Tier

CAPS = {Tier.P0: 4, Tier.P1: 100, Tier.P2: 100, Tier.P3: 100}


def _meter(rate_per_s: float, now: float = 10.0) -> ThroughputMeter:
    meter = ThroughputMeter(window_s=10.0, min_events=4)
    n = int(rate_per_s * 10)
    for i in range(n):
        meter.record(now - 10.0 + (i + 1) * 10.0 / n)
    return meter


def test_meter_needs_enough_events_before_it_estimates() -> None:
    meter = ThroughputMeter(window_s=10.0, min_events=4)
    for t in (1.0, 2.0, 3.0):
        meter.record(t)
    assert meter.rate(3.0) is None
    meter.record(4.0)
    assert meter.rate(4.0) == pytest.approx(4 / 3)
    assert meter.rate(100.0) is None  # old events leave the window


def test_queue_cap_refuses_with_the_depth() -> None:
    admission = AdmissionController(DEFAULT_TIERS, CAPS, ThroughputMeter())
    verdict = admission.check(Tier.P0, {Tier.P0: 4}, now=0.0)
    assert not verdict.admitted and verdict.reason == "queue_full" and verdict.queue_depth == 4
    assert verdict.retry_after_s >= 1.0
    assert admission.check(Tier.P0, {Tier.P0: 3}, now=0.0, left_waiting={}).admitted


def test_request_whose_estimated_wait_exceeds_its_deadline_is_refused_early() -> None:
    admission = AdmissionController(DEFAULT_TIERS, CAPS, _meter(rate_per_s=2.0))
    # P1 (target 5 s) behind 20 requests at 2/s: about 10 s.
    verdict = admission.check(Tier.P1, {Tier.P0: 5, Tier.P1: 15}, now=10.0)
    assert not verdict.admitted and verdict.reason == "deadline"
    assert verdict.estimated_wait_s == pytest.approx(10.0, rel=0.1)
    assert verdict.retry_after_s == pytest.approx(5.0, rel=0.2)
    assert verdict.queue_depth == 15


def test_only_requests_ahead_count_towards_the_wait() -> None:
    admission = AdmissionController(DEFAULT_TIERS, CAPS, _meter(rate_per_s=2.0))
    # 500 queued P2s do not delay a P0 with none ahead.
    assert admission.check(Tier.P0, {Tier.P2: 99}, now=10.0).admitted
    assert not admission.check(Tier.P0, {Tier.P0: 3}, now=10.0).admitted  # 1.5 s > 0.5 s


def test_background_tier_has_no_deadline() -> None:
    admission = AdmissionController(DEFAULT_TIERS, CAPS, _meter(rate_per_s=0.5))
    assert admission.check(Tier.P3, {Tier.P3: 99}, now=10.0).admitted


def test_with_few_starts_in_the_window_the_rate_is_that_few_over_the_window() -> None:
    """An engine that starts under 8 requests in 10 s (one sequence, long outputs) had no
    rate, so no deadline: P0 requests sent every 0.8 s were all admitted, and the last
    waited 42 s for its first token against a 0.5 s target."""
    meter = ThroughputMeter(window_s=10.0, min_events=8)
    for t in (2.0, 7.0):  # two starts in the last 10 s: 0.2 a second
        meter.record(t)
    assert meter.rate(9.0) is None and meter.cautious_rate(9.0) == pytest.approx(0.2)
    admission = AdmissionController(DEFAULT_TIERS, CAPS, meter)
    verdict = admission.check(Tier.P0, {Tier.P0: 1}, now=9.0, left_waiting={Tier.P0: 1})
    assert not verdict.admitted and verdict.reason == "deadline"
    assert verdict.estimated_wait_s == pytest.approx(5.0)
    # Room at the last pass: admitted whatever the history says (a burst after idle).
    assert admission.check(Tier.P0, {Tier.P0: 1}, now=9.0, left_waiting={}).admitted
    # No start at all in the window (idle until a burst): no estimate, nothing refused for it.
    cold = AdmissionController(DEFAULT_TIERS, CAPS, ThroughputMeter())
    verdict = cold.check(Tier.P1, {Tier.P1: 99}, now=10.0, left_waiting={Tier.P1: 99})
    assert verdict.admitted and verdict.estimated_wait_s is None


def test_no_deadline_refusal_while_the_engine_left_nobody_ahead_waiting() -> None:
    """A burst on a lightly loaded engine: the start rate is the recent demand, not the
    capacity, and the engine's last pass found room for everyone it had. Nothing is
    refused for its deadline until a pass leaves a request of the tier or above waiting."""
    admission = AdmissionController(DEFAULT_TIERS, CAPS, _meter(rate_per_s=1.0))
    queued = {Tier.P0: 2, Tier.P1: 0, Tier.P2: 0, Tier.P3: 0}
    assert admission.check(Tier.P0, queued, now=10.0, left_waiting={}).admitted
    assert admission.check(Tier.P0, queued, now=10.0, left_waiting={Tier.P2: 5}).admitted  # below it
    verdict = admission.check(Tier.P0, queued, now=10.0, left_waiting={Tier.P0: 1})
    assert not verdict.admitted and verdict.reason == "deadline"
    # The queue cap still counts everything queued.
    assert admission.check(Tier.P0, {Tier.P0: 4}, now=10.0, left_waiting={}).reason == "queue_full"
