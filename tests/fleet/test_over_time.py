"""The over-time figures of a fleet run: goodput per bin over the part of the bin that had
arrivals, so that a run's last, partly filled bin does not read as a collapse."""

from __future__ import annotations

import pytest

from tierserve.fleet.requests import COMPLETED, FleetRequest
from tierserve.fleet.summary import over_time
from tierserve.tiers import Tier
from tierserve.workloads.spec import RequestSpec

from .helpers import CONFIG


def _completed(arrivals: list[float]) -> list[FleetRequest]:
    """P3 requests (no TTFT target: completing attains) arriving at `arrivals`, all completed."""
    reqs = []
    for i, t in enumerate(arrivals):
        fr = FleetRequest(i, RequestSpec(i, Tier.P3, "t3", (1, 2, 3), 4, arrival_s=t), t)
        fr.first_token_s = t + 0.1
        fr.end(COMPLETED, t + 1.0)
        reqs.append(fr)
    return reqs


def test_a_partly_filled_last_bin_has_the_rate_of_its_arrivals() -> None:
    # One request a second for 100 s, in 60 s bins: the second bin holds 40 s of them.
    goodput = over_time(_completed([float(t) for t in range(101)]), CONFIG, 60.0)["tiers"]["P3"][
        "goodput_rps"
    ]
    assert goodput[0] == 1.0
    assert goodput[1] == pytest.approx(41 / 40)  # not 41 / 60: the same rate, not a drop by a third


def test_a_sliver_of_a_last_bin_and_a_burst_measure_no_goodput() -> None:
    # 61 s of arrivals in 60 s bins: the second bin's 1 s would claim 2 requests a second.
    reqs = _completed([float(t) for t in range(62)])
    assert over_time(reqs, CONFIG, 60.0)["tiers"]["P3"]["goodput_rps"] == [1.0, None]
    # A run shorter than half a bin is one bin over its whole span.
    assert over_time(_completed([0.0, 5.0, 10.0]), CONFIG, 60.0)["tiers"]["P3"]["goodput_rps"] == [0.3]
    # Where the run's goodput is not measured (a burst) no bin claims one.
    burst = over_time(_completed([0.0, 1e-6]), CONFIG, 60.0, measured=False)
    assert burst["tiers"]["P3"]["goodput_rps"] == [None]
