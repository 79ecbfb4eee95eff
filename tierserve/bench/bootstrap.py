"""Percentiles with 95 % bootstrap intervals (percentile method, seeded resampling)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NUM_RESAMPLES = 1000
MAX_SAMPLES = 4000  # resample at most this many values (a random subset beyond it)


@dataclass(frozen=True, slots=True)
class Estimate:
    value: float
    low: float
    high: float

    def interval(self) -> list[float]:
        return [round(self.low, 6), round(self.high, 6)]


def percentile_ci(
    values: Sequence[float], q: float, seed: int = 0, num_resamples: int = NUM_RESAMPLES
) -> Estimate | None:
    """The `q`-th percentile of `values` and its 95 % bootstrap interval; None without values.

    The estimate always lies inside its interval (the interval is widened to hold it when
    the resampled percentiles all fall to one side, as they can with few ties-heavy samples).
    """
    if not len(values):
        return None
    data = np.asarray(values, dtype=float)
    value = float(np.percentile(data, q))
    rng = np.random.default_rng([seed, 0xB007])
    if len(data) > MAX_SAMPLES:
        data = rng.choice(data, MAX_SAMPLES, replace=False)
    resamples = rng.choice(data, size=(num_resamples, len(data)), replace=True)
    stats = np.percentile(resamples, q, axis=1)
    low, high = (float(x) for x in np.percentile(stats, [2.5, 97.5]))
    return Estimate(value, min(low, value), max(high, value))
