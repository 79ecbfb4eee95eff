"""Percentiles with 95 % bootstrap intervals (percentile method, seeded resampling)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NUM_RESAMPLES = 1000
MAX_SAMPLES = 4000  # resample at most this many values (a random subset beyond it: a wider interval)


@dataclass(frozen=True, slots=True)
class Estimate:
    value: float
    low: float
    high: float

    def interval(self) -> list[float]:
        return [round(self.low, 6), round(self.high, 6)]


def percentiles_ci(
    values: Sequence[float], qs: Sequence[float], seed: int = 0, num_resamples: int = NUM_RESAMPLES
) -> list[Estimate] | None:
    """The `qs`-th percentiles of `values`, each with its 95 % bootstrap interval, from one
    set of resamples; None without values.

    An estimate always lies inside its interval (the interval is widened to hold it when the
    resampled percentiles all fall to one side, as they can with few, tied samples).
    """
    if not len(values):
        return None
    data = np.asarray(values, dtype=float)
    estimates = np.percentile(data, qs)
    rng = np.random.default_rng([seed, 0xB007])
    if len(data) > MAX_SAMPLES:
        data = rng.choice(data, MAX_SAMPLES, replace=False)
    resamples = rng.choice(data, size=(num_resamples, len(data)), replace=True)
    stats = np.percentile(resamples, qs, axis=1)  # one row per q
    out = []
    for value, row in zip(estimates, stats, strict=True):
        low, high = (float(x) for x in np.percentile(row, [2.5, 97.5]))
        out.append(Estimate(float(value), min(low, float(value)), max(high, float(value))))
    return out


def percentile_ci(
    values: Sequence[float], q: float, seed: int = 0, num_resamples: int = NUM_RESAMPLES
) -> Estimate | None:
    """`percentiles_ci` for one percentile."""
    found = percentiles_ci(values, [q], seed, num_resamples)
    return None if found is None else found[0]
