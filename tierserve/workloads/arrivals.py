"""Open-loop arrival processes: Poisson, or bursty (gamma inter-arrival times with a chosen CV)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from tierserve.workloads.spec import RequestSpec


def arrival_times(rate_rps: float, cv: float, rng: np.random.Generator) -> Iterator[float]:
    """Arrival instants (s) of a renewal process with mean rate `rate_rps`.

    Inter-arrival times are gamma with shape 1/cv^2: cv = 1 is Poisson, cv > 1 is bursty,
    cv < 1 is smoother than Poisson. The first arrival is at 0.
    """
    if rate_rps <= 0:
        raise ValueError(f"arrival rate must be > 0, got {rate_rps}")
    if cv <= 0:
        raise ValueError(f"arrival CV must be > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate_rps * shape)
    t = 0.0
    while True:
        yield t
        t += float(rng.gamma(shape, scale))


def with_arrivals(
    specs: Iterable[RequestSpec], rate_rps: float, cv: float = 1.0, seed: int = 0
) -> Iterator[RequestSpec]:
    """The same specs, arriving by `arrival_times` (seeded separately from the specs)."""
    times = arrival_times(rate_rps, cv, np.random.default_rng([seed, 0xA881]))
    for spec, t in zip(specs, times, strict=False):  # the times never run out
        yield dataclasses.replace(spec, arrival_s=t)
