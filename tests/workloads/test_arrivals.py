from __future__ import annotations

import itertools

import numpy as np
import pytest

from tierserve.workloads.arrivals import arrival_times, with_arrivals
from tierserve.workloads.synthetic import synthetic_stream


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_rate_and_burstiness_converge(cv: float) -> None:
    times = np.array(list(itertools.islice(arrival_times(4.0, cv, np.random.default_rng(1)), 40000)))
    gaps = np.diff(times)
    assert times[0] == 0
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_with_arrivals_sets_increasing_times_and_is_repeatable() -> None:
    def run() -> list[float]:
        specs = itertools.islice(with_arrivals(synthetic_stream(0, 8192), 10.0, seed=2), 50)
        times = [s.arrival_s for s in specs]
        assert all(t is not None for t in times)
        return [t for t in times if t is not None]

    times = run()
    assert times == run()
    assert times == sorted(times) and len(set(times)) == len(times)


def test_rejects_non_positive_rate() -> None:
    with pytest.raises(ValueError):
        next(arrival_times(0.0, 1.0, np.random.default_rng(0)))
