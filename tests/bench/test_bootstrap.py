from __future__ import annotations

import numpy as np

from tierserve.bench.bootstrap import percentile_ci


def lognormal(n: int, seed: int = 0) -> list[float]:
    return list(np.random.default_rng(seed).lognormal(0.0, 0.8, n))


def test_the_interval_contains_the_estimate() -> None:
    for n in (5, 40, 300, 3000):
        est = percentile_ci(lognormal(n), 95)
        assert est is not None
        assert est.low <= est.value <= est.high
        assert est.value == float(np.percentile(lognormal(n), 95))


def test_the_interval_narrows_as_samples_grow() -> None:
    widths = []
    for n in (50, 500, 5000):
        est = percentile_ci(lognormal(n), 95)
        assert est is not None
        widths.append(est.high - est.low)
    assert widths[0] > widths[1] > widths[2] > 0


def test_the_interval_covers_the_true_percentile_most_of_the_time() -> None:
    true_p95 = float(np.exp(0.8 * 1.6448536))
    covered = 0
    for seed in range(40):
        est = percentile_ci(lognormal(400, seed), 95, seed=seed, num_resamples=300)
        assert est is not None
        covered += est.low <= true_p95 <= est.high
    assert covered >= 32  # nominal 95 %; bootstrap on a P95 runs a little under


def test_no_samples_no_estimate() -> None:
    assert percentile_ci([], 95) is None
