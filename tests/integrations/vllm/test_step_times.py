"""The plug-in's fit of vLLM's step times (no vLLM needed)."""

from __future__ import annotations

import random

import pytest

from tierserve.integrations.vllm.step_times import MAX_IN_FLIGHT, MIN_STEPS, REFIT, StepTimes


def test_no_estimate_until_enough_steps_of_two_sizes() -> None:
    times = StepTimes()
    for _ in range(2 * MIN_STEPS):
        times.record(100, 0.004)  # one size only: the per-token part is unknown
    assert times.estimate_s is None
    for i in range(REFIT):
        times.record(20 + i, 0.002 + 2e-5 * (20 + i))
    assert times.estimate_s is not None


def test_the_fit_recovers_a_line_through_noisy_steps() -> None:
    rng = random.Random(0)
    times = StepTimes()
    for _ in range(256):
        n = rng.randint(16, 512)
        times.record(n, 0.0023 + 2.7e-5 * n + rng.gauss(0, 2e-4))
    estimate = times.estimate_s
    assert estimate is not None
    assert times.fixed_s == pytest.approx(0.0023, abs=2e-4)
    assert times.per_token_s == pytest.approx(2.7e-5, rel=0.05)
    assert estimate(48, 0) == pytest.approx(0.0023 + 48 * 2.7e-5, rel=0.1)
    # Each refit is a new function: the shaper's cached bound is found again.
    for _ in range(REFIT):
        times.record(64, 0.004)
    assert times.estimate_s is not estimate


def test_a_step_counts_from_when_it_could_start() -> None:
    """Async scheduling schedules a step while the one before it runs: its time starts
    when that one ends."""
    times = StepTimes()
    a, b = object(), object()
    times.scheduled(a, 10, at=0.0)
    times.scheduled(b, 20, at=0.001)  # while `a` runs
    times.finished(a, at=0.004)
    times.finished(b, at=0.010)
    times.finished(object(), at=0.02)  # never scheduled here: ignored
    assert list(times._samples) == [(10, 0.004), (20, pytest.approx(0.006))]


def test_steps_that_never_come_back_are_not_kept() -> None:
    times = StepTimes()
    times.scheduled(object(), 0, at=0.0)  # an empty step: not timed
    assert not times._scheduled
    kept = [object() for _ in range(3 * MAX_IN_FLIGHT)]
    for i, output in enumerate(kept):
        times.scheduled(output, 8, at=float(i))
    assert len(times._scheduled) <= MAX_IN_FLIGHT
