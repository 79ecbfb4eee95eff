"""A fleet that sits idle between bursts skips its scrapes up to its next event: the same
results as scraping every interval, in far fewer scrapes."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import pytest

from tierserve.fleet.autoscaler import AutoscaleConfig, ScalingPolicy
from tierserve.fleet.sim import FleetConfig, FleetResult, FleetSim
from tierserve.workloads.spec import RequestSpec

from .helpers import build_engine, specs


def _gappy() -> list[RequestSpec]:
    """Three bursts an hour apart (and one lone request between them)."""
    out: list[RequestSpec] = []
    for burst, start in enumerate((0.0, 3600.0, 5400.0, 9000.0)):
        n = 1 if burst == 2 else 40
        for s in specs(n, seed=burst, gap_s=0.2, prompt=(100, 1500), output=(10, 150)):
            out.append(replace(s, index=len(out), arrival_s=start + (s.arrival_s or 0.0)))
    return out


def _run(config: FleetConfig, skip: bool) -> tuple[FleetResult, int]:
    sim = FleetSim(config, build_engine)
    sim.skip_idle_scrapes = skip
    scrapes = 0
    scrape_all = sim._scrape_all

    def counted(ev: Any) -> None:
        nonlocal scrapes
        scrapes += 1
        scrape_all(ev)

    sim._scrape_all = counted  # type: ignore[method-assign]
    return sim.run(_gappy()), scrapes


def _comparable(result: FleetResult) -> dict[str, Any]:
    return {
        "requests": [
            dataclasses.asdict(fr) if dataclasses.is_dataclass(fr) else vars(fr) for fr in result.requests
        ],
        "end_s": result.end_s,
        "gpu_seconds": result.gpu_seconds,
        "replicas_over_time": result.replicas_over_time,
        "routed_by_reason": result.routed_by_reason,
        "num_launched": result.num_launched,
    }


@pytest.mark.parametrize(
    "config",
    [
        FleetConfig(2),
        FleetConfig(2, kills=((4000.0, 1),)),
        FleetConfig(
            2,
            autoscale=AutoscaleConfig(
                ScalingPolicy.TIER, max_replicas=4, startup_delay_s=30.0, interval_s=15.0, idle_s=300.0
            ),
        ),
    ],
    ids=["fixed", "fixed-with-a-fault", "tier-scaling"],
)
def test_skipping_an_idle_fleets_scrapes_changes_no_result(config: FleetConfig) -> None:
    skipped, few = _run(config, skip=True)
    every, many = _run(config, skip=False)
    assert _comparable(skipped) == _comparable(every)
    # Without the skip the hours between bursts are scraped every 0.5 s; with it twice per
    # autoscaler tick (15 s), which still runs.
    assert many > 5 * few
