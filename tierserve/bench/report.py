"""report.md and the printed summary: what was simulated, the tables, the warnings and the
targets. Every figure comes from results.json's pooled runs (all seeds together)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tierserve.bench.summary import MIN_P0_REQUESTS
from tierserve.bench.targets import Run, cell_name, judge

# The source article's P0 P95 TTFT (s), measured on 8 x A100-80GB (docs/design.md §7), by concurrency.
ARTICLE_P0_P95_S: Mapping[int, tuple[str, str, str]] = {
    32: ("0.8", "0.9", "0.8"),
    64: ("2.1", "1.5", "1.2"),
    128: ("8.5", "3.2", "1.8"),
    256: ("25+", "8.7", "3.5"),
    512: ("OOM", "18.3", "6.2"),
}

DIFFERENCES = """\
How this differs from the article's measured set-up:
- Nothing here ran on a GPU. Step times come from tierserve's roofline simulator
  (docs/simulator.md); the article measured a real deployment on 8 x A100-80GB.
- The engine limits are the same for every policy and printed above; the article's runs
  used 8,192 batched tokens and 512 sequences (`--engine-limits article`).
- The article's clients sent their next request as soon as the previous one ended; here
  closed-loop clients think for a random time first, and open-loop requests arrive on
  their own (Poisson, bursty or a trace's timestamps), so a request may arrive in the
  middle of a step and waits for it.
- Traffic is synthetic (or a public trace with tiers drawn at random); the article's
  traffic is not published.
- The article's figures appear below in a column of their own: they are its measurements
  on real GPUs, not results of this benchmark."""


def _fmt(x: Any, kind: str) -> str:
    if x is None:
        return "–"
    if kind == "%":
        return f"{100 * x:.1f} %"
    if kind == "x":
        return f"{x:.2f}x"
    if kind == "s":
        return _sig3(x)
    return str(x)


def _sig3(x: float) -> str:
    """Three significant digits, never in exponent form (1,200 rather than 1.2e+03, as a
    preemption's 1,199.6 s of prefill was printed)."""
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if 0 < x < 0.001:  # seconds, never negative
        return "<0.001"
    return f"{x:.3g}"


def _ci(run: Run, tier: str, name: str = "ttft_p95") -> str:
    t = run["tiers"][tier]
    if t[f"{name}_s"] is None:
        return "–"
    low, high = t[f"{name}_ci_s"]
    return f"{_sig3(t[f'{name}_s'])} [{_sig3(low)}, {_sig3(high)}]"


def _preempt(run: Run) -> str:
    """Counts, and their GPU time to three significant digits: to a tenth of a second, 20
    swaps' 0.0288 s read as 0.0 s, as if they had cost nothing."""
    p, c = run["preemptions"], run["preemption_gpu_s"]
    return (
        f"{p['swap']}/{p['recompute']}/{p['reclaim']} "
        f"({_sig3(c['swap_s'])} s swap, {_sig3(c['recompute_prefill_s'])} s prefill)"
    )


def _split(run: Run, part: str) -> str:
    """The figure P0's target judges the group by, its size, and the same figure for P0's
    traffic alone on an ideal server (`p0_reference`)."""
    group = run[f"p0_{part}_alone"]
    if not group["requests"]:
        return "–"
    kind = "%" if part == "fits" else "x"
    mine = group["slo_attainment"] if part == "fits" else group["slowdown_p95"]
    alone = group["p0_alone_attainment"] if part == "fits" else group["p0_alone_slowdown_p95"]
    return f"{_fmt(mine, kind)} ({group['requests']}; P0 alone {_fmt(alone, kind)})"


def _p3(run: Run) -> str:
    reasons = ", ".join(f"{n} {why}" for why, n in run["p3_shed_reasons"].items())
    return f"{run['p3_completed']} done / {run['p3_shed']} shed" + (f" ({reasons})" if reasons else "")


TABLES: Sequence[tuple[str, Callable[[Run], str]]] = (
    ("P0 SLO attainment (TTFT <= target)", lambda r: _fmt(r["tiers"]["P0"]["slo_attainment"], "%")),
    ("P0 P95 TTFT, s [95 % CI]", lambda r: _ci(r, "P0")),
    ("P0 slowdown P95 (each request's TTFT / its TTFT alone)", lambda r: _fmt(r["p0_slowdown_p95"], "x")),
    ("P0 whose prompt alone meets the SLO: SLO attainment (requests)", lambda r: _split(r, "fits")),
    ("P0 whose prompt alone misses the SLO: slowdown P95 (requests)", lambda r: _split(r, "long")),
    ("P1 SLO attainment", lambda r: _fmt(r["tiers"]["P1"]["slo_attainment"], "%")),
    ("P1 P95 TTFT, s [95 % CI]", lambda r: _ci(r, "P1")),
    ("P2 SLO attainment", lambda r: _fmt(r["tiers"]["P2"]["slo_attainment"], "%")),
    ("Goodput, all tiers (requests within SLO per s)", lambda r: _fmt(r["goodput_rps"], "s")),
    ("Throughput relative to fcfs", lambda r: _fmt(r["throughput_vs_fcfs"], "x")),
    ("P1 P95 TPOT, s [95 % CI]", lambda r: _ci(r, "P1", "tpot_p95")),
    ("P3 completed / shed (reason)", _p3),
    ("Preemptions swap/recompute/reclaim (GPU cost)", _preempt),
    ("Peak KV cache use", lambda r: _fmt(r["kv_peak_used"], "%")),
)


def _load_label(run: Run) -> str:
    """The load as the cell names it, and for open loops the arrivals it offered against
    the measured capacity: over the window (a trace's) and in its busiest minute."""
    label = cell_name(run).split(" ", 1)[1]
    mean, peak = run.get("offered_load_x_capacity"), run.get("peak_offered_load_x_capacity")
    if peak is None:
        return label
    if run["pattern"] == "trace" and mean is not None:
        return f"{label} ({_times(mean)} capacity; busiest minute {_times(peak)})"
    return f"{label} (busiest minute {_times(peak)})"


def _times(x: float) -> str:
    """A multiple of capacity: two decimals, or three digits where a burst makes it huge."""
    return f"{x:.2f}x" if x < 1000 else f"{x:.3g}x"


def _sections(runs: Sequence[Run]) -> list[tuple[str, str]]:
    return list(dict.fromkeys((r["workload"], r["pattern"]) for r in runs))


def table(runs: Sequence[Run], title: str, value: Callable[[Run], str], article: bool = False) -> str:
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    head = ["load", *policies] + (
        ["article, measured on real GPUs (no priority / DRR / its policy)"] if article else []
    )
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for load in dict.fromkeys(r["load"] for r in runs):
        cells = [r for r in runs if r["load"] == load]
        row = [_load_label(cells[0])]
        row += [next((value(r) for r in cells if r["policy"] == p), "–") for p in policies]
        if article:
            row.append(" / ".join(ARTICLE_P0_P95_S.get(int(load), ("–", "–", "–"))))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def results_tables(runs: Sequence[Run]) -> str:
    parts = []
    for workload, pattern in _sections(runs):
        cells = [r for r in runs if r["workload"] == workload and r["pattern"] == pattern]
        parts.append(f"### {workload}, {pattern} ({cells[0]['arrival']} loop)\n")
        for title, value in TABLES:
            article = workload == "default" and pattern == "closed" and title.startswith("P0 P95 TTFT")
            parts.append(table(cells, title, value, article))
    return "\n".join(parts)


def warnings(runs: Sequence[Run]) -> list[str]:
    small = [
        f"{cell_name(r)}, {r['policy']}: P0 figures rest on {r['p0_requests']} requests "
        f"(fewer than {MIN_P0_REQUESTS}); its P95s are close to its maximum"
        for r in runs
        if r["low_sample"]
    ]
    unmeasured = [
        f"{cell_name(r)}, {r['policy']}: goodput not measured: {why}; a longer run (--requests) measures it"
        for r in runs
        if (why := r.get("goodput_unmeasured"))
    ]
    return small + unmeasured


def targets_section(runs: Sequence[Run]) -> str:
    lines = ["## Targets (hybrid)", ""]
    lines += [f"- **{v.label()}**: {v.target}. {v.detail}" for v in judge(runs)]
    return "\n".join(lines) + "\n"


def _setup_lines(results: Mapping[str, Any]) -> list[str]:
    setup = {k: v for k, v in results["setup"].items() if k != "input_warnings"}  # a section of its own
    lines = [f"- **{k}**: {json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in setup.items()]
    capacity = results.get("capacity", {})
    for w, c in capacity.items():
        lines.append(f"- **capacity of {w}**: {c['requests_per_s']} requests/s ({c['how']})")
    for w in results["setup"].get("trace_rows_read", {}):
        if w not in capacity:
            lines.append(
                f"- **capacity of {w}**: not measured (too few rows to saturate the engine), so its "
                "offered load is not given as a multiple of it"
            )
    return lines


def _trace_notes(results: Mapping[str, Any]) -> list[str]:
    """What a report read later must not miss: trace rows that ran shortened."""
    setup = results["setup"]
    read = setup.get("trace_rows_read", {})
    return [
        f"**{cut} of {w}'s {read[w]} rows {'was' if cut == 1 else 'were'} cut to fit the model's context** "
        "(the output to at most half of it, the prompt to the rest): "
        f"{'that request is' if cut == 1 else 'those requests are'} not the trace's."
        for w, cut in setup.get("trace_rows_cut_to_context", {}).items()
        if cut
    ]


def markdown(results: Mapping[str, Any]) -> str:
    runs = results["pooled"]
    seeds = results["setup"]["seeds"]
    lines = ["# tierserve bench reproduce", ""]
    if results["setup"].get("quick"):
        lines += [
            "**Quick run: small samples. P0 figures rest on few requests; read them as a smoke test.**",
            "",
        ]
    lines += ["## What was simulated", "", *_setup_lines(results), "", DIFFERENCES, ""]
    if warned := results["setup"].get("input_warnings"):  # a unit that looks misread, rows skipped
        lines += ["## Warnings on the traces", "", *(f"- {w}" for w in warned), ""]
    lines += [line for note in _trace_notes(results) for line in (note, "")]
    lines += [
        f"Every figure is pooled over the seeds {seeds}: their measured requests together, "
        "percentiles over all of them, goodput over their summed arrival spans and throughput over "
        "their summed windows. "
        "Definitions: docs/benchmark.md.",
        "",
    ]
    warned = warnings(runs)
    lines += ["## Sample-size warnings", ""] + ([f"- {w}" for w in warned] or ["- none"]) + [""]
    lines += [targets_section(runs), "## Results", "", results_tables(runs)]
    lines += ["![P0 SLO attainment](p0_attainment.png)", "", "![Goodput](goodput.png)", ""]
    return "\n".join(lines)


def summary_text(results: Mapping[str, Any]) -> str:
    runs = results["pooled"]
    parts = []
    for title, value in (TABLES[0], TABLES[6]):
        for w, p in _sections(runs):
            cells = [r for r in runs if (r["workload"], r["pattern"]) == (w, p)]
            parts.append(table(cells, f"{title}: {w}, {p}", value))
    small = sum(bool(r["low_sample"]) for r in runs)
    if small:
        parts.append(
            f"{small} {'run' if small == 1 else 'runs'} (a cell under one policy) "
            f"{'has' if small == 1 else 'have'} fewer than {MIN_P0_REQUESTS} P0 requests "
            "(report.md lists them)\n"
        )
    unmeasured = sum(bool(r.get("goodput_unmeasured")) for r in runs)
    if unmeasured:
        parts.append(
            f"{unmeasured} runs measured no goodput: their requests arrived within less than "
            "their median latency (report.md says why)\n"
        )
    return "\n".join(parts) + "\n" + targets_section(runs)


def write_all(out: Path, results: Mapping[str, Any]) -> list[Path]:
    from tierserve.bench.plots import plot_against_load

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "report.md", out / "p0_attainment.png", out / "goodput.png"]
    paths[0].write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    paths[1].write_text(markdown(results))
    plot_against_load(
        paths[2],
        results["pooled"],
        "P0 SLO attainment",
        lambda r: r["tiers"]["P0"]["slo_attainment"],
        fraction=True,
    )
    plot_against_load(
        paths[3], results["pooled"], "goodput (requests within SLO / s)", lambda r: r["goodput_rps"]
    )
    return paths
