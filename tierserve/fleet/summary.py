"""A fleet run's figures: per-tier SLO attainment and goodput, over the run and over time.

Definitions (as `tierserve bench`'s, at the gateway): TTFT = first token at the client -
arrival at the gateway, so it includes the gateway queue and any retries. A request
attains its tier's SLO when its TTFT is within `ttft_target_s` and it completes; a tier
with no target (P3) attains it by completing. Refused, lost, rejected, shed and
unfinished requests miss it. Attainment = attained / arrived. Goodput = attained requests
per second of the run up to its last arrival; not measured (None) where the requests
arrived within less than their median latency (a burst, a rate scaled far past the
fleet's capacity), whose attained requests over that span would claim a rate no fleet
served. GPU-hours count every replica from its launch (model loading
included) to its stop, death or the end of the run, times its GPUs.

Runs compared side by side (`align`) are taken over the same window and by the same rule:
GPU-hours to the latest end among them, and goodput measured in all of them or in none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import numpy as np

from tierserve.bench.summary import short_span
from tierserve.config import EngineConfig
from tierserve.fleet.autoscaler import AutoscaleConfig, Autoscaler, Observation, ScalingPolicy
from tierserve.fleet.requests import (
    COMPLETED,
    LOST,
    REFUSED_PREFIX,
    REJECTED,
    SHED,
    UNFINISHED,
    FleetRequest,
)
from tierserve.fleet.sim import FleetResult
from tierserve.tiers import ALL_TIERS, Tier


def attained(fr: FleetRequest, config: EngineConfig) -> bool:
    if fr.outcome != COMPLETED:
        return False
    target = config.tier(fr.tier).ttft_target_s
    return math.isinf(target) or (fr.ttft_s is not None and fr.ttft_s <= target)


def _percentile(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def tier_figures(reqs: Sequence[FleetRequest], config: EngineConfig, span_s: float) -> dict[str, Any]:
    ttfts = [fr.ttft_s for fr in reqs if fr.ttft_s is not None]
    num_attained = sum(attained(fr, config) for fr in reqs)
    return {
        "num_requests": len(reqs),
        "slo_attainment": num_attained / len(reqs) if reqs else None,
        "goodput_rps": num_attained / span_s if span_s > 0 else None,
        "num_completed": sum(fr.outcome == COMPLETED for fr in reqs),
        "num_refused": sum((fr.outcome or "").startswith(REFUSED_PREFIX) for fr in reqs),
        "num_lost": sum(fr.outcome == LOST for fr in reqs),
        "num_shed": sum(fr.outcome == SHED for fr in reqs),
        "num_rejected": sum(fr.outcome == REJECTED for fr in reqs),
        "num_unfinished": sum(fr.outcome in (None, UNFINISHED) for fr in reqs),
        "num_retried": sum(fr.num_retries > 0 for fr in reqs),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
    }


def over_time(
    reqs: Sequence[FleetRequest], config: EngineConfig, bin_s: float, measured: bool = True
) -> dict[str, Any]:
    """Per tier and per bin of arrival time: SLO attainment and goodput (attained per second
    of the bin's part within the arrivals' span).

    The arrivals rarely fill the last bin (a 100 s run in 60 s bins has 40 s in its second):
    attained requests over the whole width read as a collapse at the end of every run. A
    bin's goodput is over the part of it the arrivals span, and None where that part is
    under half a bin (a few requests over a fraction of a second would claim a spike) and
    not the whole span (a run shorter than half a bin has one bin, its whole span); None in
    every bin where the run's goodput is not `measured` (a burst, `summarize`)."""
    if not reqs:
        return {"bin_s": bin_s, "t_s": [], "tiers": {}}
    first = min(fr.arrival_s for fr in reqs)
    last = max(fr.arrival_s for fr in reqs)
    num_bins = int(last // bin_s) + 1
    spans = [min((i + 1) * bin_s, last) - max(i * bin_s, first) for i in range(num_bins)]
    shortest = min(bin_s / 2, last - first)
    widths = [w if measured and w > 0 and w >= shortest else None for w in spans]
    tiers: dict[str, Any] = {}
    for tier in ALL_TIERS:
        arrived, ok = [0] * num_bins, [0] * num_bins
        for fr in reqs:
            if fr.tier is tier:
                b = int(fr.arrival_s // bin_s)
                arrived[b] += 1
                ok[b] += attained(fr, config)
        tiers[tier.name] = {
            "num_requests": arrived,  # what each bin's attainment rests on
            "slo_attainment": [o / a if a else None for o, a in zip(ok, arrived, strict=True)],
            "goodput_rps": [None if w is None else o / w for o, w in zip(ok, widths, strict=True)],
        }
    return {"bin_s": bin_s, "t_s": [i * bin_s for i in range(num_bins)], "tiers": tiers}


def summarize(result: FleetResult, config: EngineConfig, bin_s: float) -> dict[str, Any]:
    reqs = result.requests
    # The arrivals' span, as `bench reproduce` measures it: a trace whose requests all come at
    # once has none, and its goodput is not measured (`short_span`).
    span = max((fr.arrival_s for fr in reqs), default=0.0) - min((fr.arrival_s for fr in reqs), default=0.0)
    unmeasured = short_span(span, [fr.finish_s - fr.arrival_s for fr in reqs if fr.finish_s is not None])
    by_tier = {t: [fr for fr in reqs if fr.tier is t] for t in ALL_TIERS}
    outcomes: dict[str, int] = {}
    for fr in reqs:
        outcomes[fr.outcome or UNFINISHED] = outcomes.get(fr.outcome or UNFINISHED, 0) + 1
    tiers = {t.name: tier_figures(by_tier[t], config, 0.0 if unmeasured else span) for t in ALL_TIERS}
    for t in ALL_TIERS:
        target = config.tier(t).ttft_target_s
        tiers[t.name]["ttft_target_s"] = None if math.isinf(target) else target
    return {
        "num_requests": len(reqs),
        "duration_s": result.end_s,
        "last_arrival_s": max((fr.arrival_s for fr in reqs), default=0.0),
        "gpu_hours": result.gpu_seconds / 3600.0,
        "gpu_hours_common": result.gpu_seconds / 3600.0,  # `align` takes it to a common end
        "common_end_s": result.end_s,
        # [serving (draining included), starting] when the run ended: what `align` keeps on.
        "replicas_at_end": list(result.replicas_over_time[-1][1:]) if result.replicas_over_time else [0, 0],
        "num_replicas_launched": result.num_launched,
        "outcomes": outcomes,
        "num_retried": sum(fr.num_retries > 0 for fr in reqs),
        "num_lost": outcomes.get(LOST, 0),
        "routed_by_reason": result.routed_by_reason,
        "goodput_unmeasured": unmeasured,
        "tiers": tiers,
        "over_time": over_time(reqs, config, bin_s, measured=not unmeasured),
        "replicas_over_time": [list(x) for x in result.replicas_over_time],
        "faults": [list(x) for x in result.faults],
    }


def p0_attainment(summary: dict[str, Any]) -> float | None:
    value: float | None = summary["tiers"][Tier.P0.name]["slo_attainment"]
    return value


def align(
    runs: Sequence[dict[str, Any]],
    num_gpus_per_replica: int,
    autoscale_config: Callable[[str], AutoscaleConfig],
) -> None:
    """Make the runs of one comparison (`{"router", "scaling", "summary"}` each) comparable, in
    place:

    - GPU-hours to the latest end among them (`gpu_hours_common`). A run ends when its last
      request does, so a router that refused requests ended sooner and read as the cheaper
      fleet (the same fixed two replicas: 0.410 against 1.02 GPU-h). After its end a run's
      fleet stands on idle, as its autoscaler (`autoscale_config(scaling)`) keeps it: a
      fixed fleet whole, an autoscaling one as `_idle_replica_seconds` ticks it.
    - GPU-hours from the start to the last arrival (`gpu_hours_arrivals`), the same window
      in every run: to the latest end, a run that scaled in early still paid for the idle
      tail left by the slowest one (a fixed fleet draining its unfinished requests), 6.15
      GPU-h to its own end read as 21.0.
    - Goodput measured in every run or in none: whether it is depends on the run's latencies
      (`short_span`), and a router that refused many requests at once (their latency is
      the wait before the refusal) was the only one measured."""
    if not runs:
        return
    end = max(r["summary"]["duration_s"] for r in runs)
    for r in runs:
        s = r["summary"]
        replica_s = _replica_seconds_until(s["replicas_over_time"], s["last_arrival_s"])
        s["gpu_hours_arrivals"] = replica_s * num_gpus_per_replica / 3600.0
        serving, starting = s["replicas_at_end"]
        config = autoscale_config(r["scaling"])
        idle_s = _idle_replica_seconds(serving, starting, config, s["duration_s"], end)
        s["gpu_hours_common"] = s["gpu_hours"] + idle_s * num_gpus_per_replica / 3600.0
        s["common_end_s"] = end
    first = next((r for r in runs if r["summary"]["goodput_unmeasured"]), None)
    if first is None:
        return
    why = f"not measured in {first['router']} / {first['scaling']}: {first['summary']['goodput_unmeasured']}"
    for r in runs:
        if not r["summary"]["goodput_unmeasured"]:
            unmeasure(r["summary"], why)


def _replica_seconds_until(curve: Sequence[Sequence[float]], until_s: float) -> float:
    """Replica-seconds (serving and starting) of a `replicas_over_time` step curve, from the
    start to `until_s`."""
    total = 0.0
    for (t, serving, starting), (t_next, *_) in pairwise(curve):
        if t >= until_s:
            break
        total += (serving + starting) * (min(t_next, until_s) - t)
    return total


def _idle_replica_seconds(
    serving: int, starting: int, config: AutoscaleConfig, end_s: float, until_s: float
) -> float:
    """Replica-seconds from `end_s` to `until_s` of a fleet left idle, as its autoscaler scales
    it: the real `Autoscaler`, at the fleet's ticks (every `interval_s` from 0), seeing no
    load, no queue and no P0 at risk. At most what the fleet would spend: the autoscaler
    starts calm at the first tick after the end (the fleet may have been calm before), and
    a replica starting at the end is taken to be ready a whole start-up delay later (when it
    was launched is not kept)."""
    if config.policy is ScalingPolicy.FIXED:
        return (serving + starting) * max(0.0, until_s - end_s)
    scaler = Autoscaler(config)
    ready_at = [end_s + config.startup_delay_s] * starting
    total, t = 0.0, end_s
    tick = math.floor(end_s / config.interval_s) * config.interval_s + config.interval_s
    while t < until_s:
        if not ready_at and serving == config.min_replicas:  # nothing will change
            return total + serving * (until_s - t)
        step_end = min(tick, until_s)
        total += (serving + len(ready_at)) * (step_end - t)
        t = step_end
        if t >= until_s:
            break
        serving += sum(at <= t for at in ready_at)
        ready_at = [at for at in ready_at if at > t]
        idle = [0.0] * serving
        obs = Observation(t, serving, len(ready_at), idle, idle, 0, None, kv_usage=idle, token_load=idle)
        change = scaler.decide(obs)
        if change > 0:
            ready_at.append(t + config.startup_delay_s)
        elif change < 0:
            serving += change
        tick += config.interval_s
    return total


def unmeasure(summary: dict[str, Any], why: str) -> None:
    """Take a run's goodput figures out (None), with the reason."""
    summary["goodput_unmeasured"] = why
    for figures in summary["tiers"].values():
        figures["goodput_rps"] = None
    for series in summary["over_time"]["tiers"].values():
        series["goodput_rps"] = [None] * len(series["goodput_rps"])
