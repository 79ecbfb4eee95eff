"""`tierserve bench vllm`'s figures: per run, P0 TTFT alone and under the flood, per-tier
SLO attainment, throughput, preemptions; across runs, the ratios the targets are set on."""

from __future__ import annotations

import math
import statistics
from typing import Any

TTFT_TARGETS_S = (0.5, 5.0, 60.0, math.inf)  # docs/design.md §1, P0..P3


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    recs = list(result["requests"].values())

    def p0(phase: str) -> list[float]:
        return [
            r["ttft_s"] for r in recs if r["phase"] == phase and r["tier"] == 0 and r["ttft_s"] is not None
        ]

    flood = [r for r in recs if r["phase"] == "flood"]
    slo: dict[str, float] = {}
    for tier, target in enumerate(TTFT_TARGETS_S):
        mine = [r for r in flood if r["tier"] == tier]
        if mine:
            met = sum(1 for r in mine if r["ttft_s"] is not None and r["ttft_s"] <= target)
            slo[f"P{tier}"] = met / len(mine)
    makespan = result["flood_makespan_s"]
    tokens = sum(r["tokens"] for r in flood)
    waits = [r["wait_s"] for r in flood if r["tier"] == 0 and "wait_s" in r]
    steps = result.get("flood_step_s") or []
    return {
        "p0_ttft_p50_alone_s": _quantile(p0("alone"), 0.5),
        "p0_ttft_p95_alone_s": _quantile(p0("alone"), 0.95),
        "p0_ttft_p50_flood_s": _quantile(p0("flood"), 0.5),
        "p0_ttft_p95_flood_s": _quantile(p0("flood"), 0.95),
        # Of P0's TTFT under the flood: the rest of the step in flight when it arrived.
        "p0_wait_for_step_p95_flood_s": _quantile(waits, 0.95),
        "flood_step_p50_s": _quantile(steps, 0.5),
        "flood_step_p95_s": _quantile(steps, 0.95),
        # Output tokens a step of the flood carried on average: how many requests decode at
        # once, which memory set aside (P0's floor) lowers. Unlike tokens/s it does not move
        # with the host's speed.
        "flood_steps": len(steps),
        "flood_tokens_per_step": tokens / len(steps) if steps else None,
        "throughput_tokens_per_s": tokens / makespan if makespan > 0 else None,
        "slo_attainment": slo,
        "preemptions": result.get("preemptions"),
        "num_requests": len(recs),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def compare(runs: dict[str, Any]) -> dict[str, Any]:
    plugin, fcfs = runs.get("tierserve-plugin", {}), runs.get("vllm-fcfs", {})
    prio, engine = runs.get("vllm-priority", {}), runs.get("tierserve-engine", {})
    return {
        "plugin_p0_flood_over_alone": _ratio(
            plugin.get("p0_ttft_p95_flood_s"), plugin.get("p0_ttft_p95_alone_s")
        ),
        "plugin_p0_flood_over_vllm_priority": _ratio(
            plugin.get("p0_ttft_p95_flood_s"), prio.get("p0_ttft_p95_flood_s")
        ),
        "plugin_throughput_over_vllm_fcfs": _ratio(
            plugin.get("throughput_tokens_per_s"), fcfs.get("throughput_tokens_per_s")
        ),
        "engine_throughput_over_vllm_fcfs": _ratio(
            engine.get("throughput_tokens_per_s"), fcfs.get("throughput_tokens_per_s")
        ),
    }


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def render(res: dict[str, Any]) -> str:
    lines = [
        "run                 p0 p95 alone  p0 p95 flood  (its wait for the step in flight)"
        "  step p50  tokens/s  tok/step  preempt  slo"
    ]
    for name, r in res["runs"].items():
        slo = " ".join(f"{t}={v:.2f}" for t, v in r["slo_attainment"].items())
        lines.append(
            f"{name:<19} {_fmt(r['p0_ttft_p95_alone_s']):>12}  {_fmt(r['p0_ttft_p95_flood_s']):>12}  "
            f"{_fmt(r.get('p0_wait_for_step_p95_flood_s')):>34}  {_fmt(r.get('flood_step_p50_s')):>8}  "
            f"{_fmt(r['throughput_tokens_per_s']):>8}  {_fmt(r.get('flood_tokens_per_step')):>8}  "
            f"{_fmt(r['preemptions']):>7}  {slo}"
        )
    repeats = res.get("repeats") or []
    for k, v in res["comparisons"].items():
        each = ", ".join(_fmt(r["comparisons"].get(k)) for r in repeats)
        each = f"  (each repeat: {each})" if repeats else ""
        lines.append(f"{k}: {_fmt(v)}{each}")
    lines.append(
        "(seconds; the step p50 is the flood phase's, as the driver times it; tok/step: output tokens "
        "per flood step)"
    )
    if repeats:
        lines.append(f"(every figure is the median of {len(repeats)} repeats, the contenders in turn)")
    return "\n".join(lines)
