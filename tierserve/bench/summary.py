"""The figures of a cell (one seed) or of a pooled group of cells (several seeds): one
`runs` entry of results.json.

Pooling concatenates the seeds' measured requests and adds up their windows, so a pooled
P95 is the P95 of all the requests, and goodput and throughput are totals over total time.
Definitions (docs/benchmark.md restates them):
- TTFT = first token - arrival; a request given up at the end of the run without a first
  token counts with its wait until then (a lower bound). TPOT = (finish - first token) /
  (output tokens - 1).
- SLO attained: TTFT <= the tier's target; a tier without one (P3) attains it by finishing.
  Goodput = attained requests / the span of the measured arrivals (the rate at which
  requests that meet their SLO are served); not measured (None) where the measured
  requests arrived within less than their median latency (`_goodput_unmeasured`).
  Throughput = tokens generated in the window
  (first measured arrival to last measured end) / its length.
- P0 slowdown of a request = its TTFT / its own TTFT alone on an idle engine (`IdleTtft`).
  The P0 requests split by that idle TTFT: those whose prompt alone meets the SLO
  (`p0_fits_alone`, judged by attainment) and those whose prompt alone misses it
  (`p0_long_alone`, judged by slowdown). Beside each, the same figure for P0's own
  traffic alone under an ideal shortest-first server (`p0_reference`): what P0 requests
  arriving together cost each other whatever the policy.
- A preemption is a reclaim when a request of a more urgent tier was admitted in the same
  step (memory taken back for it), whatever its mode (swap or recompute).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tierserve.bench.bootstrap import percentile_ci, percentiles_ci
from tierserve.bench.cell import CellResult
from tierserve.bench.metrics import RequestRecord
from tierserve.bench.p0_reference import srpt_slowdowns
from tierserve.config import EngineConfig
from tierserve.request import RequestStatus
from tierserve.tiers import ALL_TIERS, Tier

MIN_P0_REQUESTS = 300  # below this, P0 percentiles rest on too few samples: the report warns


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _ttft(r: RequestRecord) -> float | None:
    if r.status is RequestStatus.REJECTED:
        return None
    return (r.first_token_s if r.first_token_s is not None else r.finish_s) - r.arrival_s


def _tpot(r: RequestRecord) -> float | None:
    if r.status is not RequestStatus.FINISHED or r.first_token_s is None or r.num_output_tokens < 2:
        return None
    return (r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)


def _attained(r: RequestRecord, target_s: float) -> bool:
    if target_s == float("inf"):
        return r.status is RequestStatus.FINISHED
    return r.first_token_s is not None and r.first_token_s - r.arrival_s <= target_s


def _percentiles(name: str, values: Sequence[float], seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    qs = (50, 95, 99)
    found = percentiles_ci(values, qs, seed)
    for k, q in enumerate(qs):
        out[f"{name}_p{q}_s"] = None if found is None else _r(found[k].value)
        out[f"{name}_p{q}_ci_s"] = None if found is None else found[k].interval()
    return out


def _tier(records: Sequence[RequestRecord], target_s: float, span_s: float, seed: int) -> dict[str, Any]:
    attained = sum(_attained(r, target_s) for r in records)
    ttfts = [t for r in records if (t := _ttft(r)) is not None]
    tpots = [t for r in records if (t := _tpot(r)) is not None]
    shed = Counter(r.end_reason or r.status.value for r in records if r.status is not RequestStatus.FINISHED)
    return {
        "requests": len(records),
        "completed": sum(r.status is RequestStatus.FINISHED for r in records),
        "shed": sum(shed.values()),
        "shed_reasons": dict(sorted(shed.items())),
        "preempted": sum(len(r.preemptions) for r in records),
        "waited_for_lower_memory": sum(r.num_memory_waits > 0 for r in records),
        "slo_attainment": _r(attained / len(records)) if records else None,
        "goodput_rps": _r(attained / span_s) if span_s > 0 else None,
        **_percentiles("ttft", ttfts, seed),
        **_percentiles("tpot", tpots, seed),
    }


def _preemptions(results: Sequence[CellResult]) -> dict[str, Any]:
    counts = Counter[str]()
    cost: dict[str, float] = {"swap_s": 0.0, "recompute_prefill_s": 0.0}
    for res in results:
        urgent: dict[float, int] = {}  # step time -> most urgent tier admitted in it
        for r in res.run.records:
            for t in r.admitted_s:
                urgent[t] = min(urgent.get(t, len(ALL_TIERS)), int(r.tier))
        for r in (r for r in res.run.records if r.measured):
            for p in r.preemptions:
                counts["swap" if p.swapped else "recompute"] += 1
                counts["reclaim"] += urgent.get(p.time_s, len(ALL_TIERS)) < int(r.tier)
                cost["swap_s" if p.swapped else "recompute_prefill_s"] += res.preemption_cost_s[
                    (p.swapped, p.amount)
                ]
    return {
        "preemptions": {k: counts[k] for k in ("swap", "recompute", "reclaim")},
        "preemption_gpu_s": {k: round(cost[k], 4) for k in ("swap_s", "recompute_prefill_s")},
    }


def _p0_against_idle(results: Sequence[CellResult], target_s: float, seed: int) -> dict[str, Any]:
    """Each measured P0 request against its own TTFT alone on an idle engine: the slowdown
    of all of them, and the split the P0 target judges by: the prompts that alone meet the
    SLO (judged by attainment) and those that alone miss it (judged by slowdown)."""
    slowdowns: list[float] = []
    fits: list[bool] = []  # TTFT <= target, for the prompts that fit alone
    long_slowdowns: list[float] = []
    ref_fits: list[bool] = []  # the same, for P0's own traffic alone (`p0_reference`)
    ref_long: list[float] = []
    for res in results:
        jobs: list[tuple[float, float]] = []
        for r in res.run.records:
            idle = res.p0_idle_ttft_s.get(r.index)
            if not r.measured or r.tier is not Tier.P0 or idle is None:
                continue
            if (ttft := _ttft(r)) is None:  # rejected: a miss, whatever its prompt
                fits.append(False)
                continue
            jobs.append((r.arrival_s, idle))
            slowdowns.append(ttft / idle)
            if idle > target_s:
                long_slowdowns.append(ttft / idle)
            else:
                fits.append(_attained(r, target_s))
        for (_, idle), ref in zip(jobs, srpt_slowdowns(jobs), strict=True):
            if idle > target_s:
                ref_long.append(ref)
            else:
                ref_fits.append(ref * idle <= target_s)
    slow = percentile_ci(slowdowns, 95, seed)
    long_slow = percentile_ci(long_slowdowns, 95, seed)
    return {
        "p0_slowdown_p95": None if slow is None else _r(slow.value),
        "p0_slowdown_p95_ci": None if slow is None else slow.interval(),
        "p0_idle_over_slo_share": _r(len(long_slowdowns) / len(slowdowns)) if slowdowns else None,
        "p0_fits_alone": {
            "requests": len(fits),
            "slo_attainment": _r(sum(fits) / len(fits)) if fits else None,
            "p0_alone_attainment": _r(sum(ref_fits) / len(ref_fits)) if ref_fits else None,
        },
        "p0_long_alone": {
            "requests": len(long_slowdowns),
            "slowdown_p95": None if long_slow is None else _r(long_slow.value),
            "slowdown_p95_ci": None if long_slow is None else long_slow.interval(),
            "p0_alone_slowdown_p95": _r(float(np.percentile(ref_long, 95))) if ref_long else None,
        },
    }


OFFERED_LOAD_WINDOW_S = 60.0  # the busiest such window of arrivals is reported too


def _sent_times(result: CellResult) -> list[float]:
    """When the workload sent each measured request (a held conversation turn: when sent)."""
    records = result.run.records
    return sorted(r.arrival_s if r.scheduled_s is None else r.scheduled_s for r in records if r.measured)


def _offered_load(results: Sequence[CellResult]) -> dict[str, float | None]:
    """Open loop: the measured requests' arrival rate as a multiple of the workload's
    capacity, over the whole window and in its busiest OFFERED_LOAD_WINDOW_S (a trace's
    mean can sit well under capacity while its bursts are several times over it). None
    for closed loops, whose arrivals follow the policy, and where no capacity was measured."""
    capacity = results[0].capacity_rps
    if results[0].cell.arrival != "open" or not capacity:
        return {"offered_load_x_capacity": None, "peak_offered_load_x_capacity": None}
    count, span, peak_rps = 0, 0.0, 0.0
    for res in results:
        times, seed_span = _sent_times(res), _arrival_span(res)
        count += max(0, len(times) - 1)  # arrivals after the first, over the span
        span += seed_span
        busiest, start = 0, 0
        for end, t in enumerate(times):
            while t - times[start] >= OFFERED_LOAD_WINDOW_S:
                start += 1
            busiest = max(busiest, end - start + 1)
        if seed_span > 0:
            peak_rps = max(peak_rps, busiest / min(OFFERED_LOAD_WINDOW_S, seed_span))
    return {
        "offered_load_x_capacity": _r(count / span / capacity) if span > 0 else None,
        "peak_offered_load_x_capacity": _r(peak_rps / capacity) if span > 0 else None,
    }


def _arrival_span(result: CellResult) -> float:
    """From the first measured arrival to the last: goodput's denominator (the window runs
    on until the slowest measured request ends, which says nothing about the rate served).
    Open loop, the arrivals are the workload's own: a conversation turn held for its previous
    answer is sent later under a slower policy, and that must not lengthen the span over
    which the same offered load is counted."""
    times = _sent_times(result)
    return times[-1] - times[0] if times else 0.0


def short_span(span_s: float, latencies: Sequence[float]) -> str | None:
    """Why goodput cannot be measured over arrivals spanning `span_s`, or None. Requests that
    arrive within less than their own median latency (arrival to end) — a burst, a load far
    past capacity over a short run — are mostly served after the last of them arrived:
    attained requests over that span would claim a rate no engine served (50 requests sent
    within a microsecond are not served at 5e7 a second), and no other span is the same for
    every policy. `tierserve bench fleet` applies the same rule."""
    if not latencies:
        if span_s > 0:
            return None
        # Nothing finished to compare with (every request refused, say), and no span either.
        return "the measured requests all arrived at one instant: there is no span to measure a rate over"
    if span_s >= (median := float(np.median(latencies))):
        return None
    return (
        f"the measured requests arrived within {span_s:.3g} s, less than their median latency "
        f"({median:.3g} s): a rate over so short a span says nothing about the rate served"
    )


def _goodput_unmeasured(result: CellResult) -> str | None:
    return short_span(
        _arrival_span(result), [r.finish_s - r.arrival_s for r in result.run.records if r.measured]
    )


def _goodput_of(result: CellResult, config: EngineConfig) -> float | None:
    """One seed's goodput, as the pooled figure counts it (all tiers within their targets
    per second of arrivals): the seeds side by side say how far a pooled gap is noise."""
    span = _arrival_span(result)
    if span <= 0:
        return None
    targets = {t: config.tier(t).ttft_target_s for t in ALL_TIERS}
    attained = sum(_attained(r, targets[r.tier]) for r in result.run.records if r.measured)
    return _r(attained / span)


def summarize(results: Sequence[CellResult], config: EngineConfig) -> dict[str, Any]:
    """The results.json entry of `results`: one cell, or the same cell over several seeds."""
    first = results[0].cell
    if any(res.cell.group != first.group or res.cell.policy != first.policy for res in results):
        raise ValueError("only the same cell over several seeds can be pooled")
    measured = [r for res in results for r in res.run.records if r.measured]
    span = sum(res.run.window.duration_s for res in results)
    unmeasured = next((why for res in results if (why := _goodput_unmeasured(res))), None)
    arrivals = 0.0 if unmeasured else sum(_arrival_span(res) for res in results)
    tokens = sum(res.run.window.num_generated_tokens for res in results)
    seed = first.seed
    tiers = {
        t.name: _tier([r for r in measured if r.tier is t], config.tier(t).ttft_target_s, arrivals, seed)
        for t in ALL_TIERS
    }
    p0 = _p0_against_idle(results, config.tier(Tier.P0).ttft_target_s, seed)
    peak = max(res.run.window.peak_used_blocks / res.num_device_blocks for res in results)
    seeds = [res.cell.seed for res in results]
    return {
        "policy": first.policy,
        "workload": first.workload,
        "arrival": first.arrival,
        "pattern": first.pattern,
        "load": first.load if first.pattern != "closed" else int(first.load),
        "seed": seeds[0] if len(seeds) == 1 else seeds,
        "rate_rps": _r(results[0].rate_rps),
        **_offered_load(results),
        "tiers": tiers,
        "p0_requests": tiers["P0"]["requests"],
        "low_sample": tiers["P0"]["requests"] < MIN_P0_REQUESTS,
        **p0,
        "goodput_rps": None if unmeasured else _r(sum(t["goodput_rps"] or 0.0 for t in tiers.values())),
        "goodput_rps_by_seed": None if unmeasured else [_goodput_of(res, config) for res in results],
        "goodput_unmeasured": unmeasured,
        "throughput_tokens_per_s": _r(tokens / span) if span > 0 else None,
        "throughput_vs_fcfs": None,  # filled in once fcfs's cell is known
        "p3_completed": tiers["P3"]["completed"],
        "p3_shed": tiers["P3"]["shed"],
        "p3_shed_reasons": tiers["P3"]["shed_reasons"],
        **_preemptions(results),
        "kv_peak_used": _r(peak),
        "window_s": _r(span),
    }


def add_throughput_vs_fcfs(runs: Sequence[dict[str, Any]], baseline: str = "fcfs") -> None:
    """Set each run's `throughput_vs_fcfs` from the fcfs run of the same cell and seed(s)."""

    def key(run: Mapping[str, Any]) -> tuple[str, str, float, str]:
        return (run["workload"], run["pattern"], run["load"], str(run["seed"]))

    base = {key(r): r for r in runs if r["policy"] == baseline}
    for run in runs:
        ref = base.get(key(run))
        if ref and ref["throughput_tokens_per_s"] and run["throughput_tokens_per_s"] is not None:
            run["throughput_vs_fcfs"] = _r(run["throughput_tokens_per_s"] / ref["throughput_tokens_per_s"])
