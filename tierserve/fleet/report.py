"""A fleet bench's report.md and plots, from the runs' summaries (results.json's `runs`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tierserve.fleet.sim import FleetConfig
from tierserve.tiers import ALL_TIERS

Run = Mapping[str, Any]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def rate_text(x: float | None) -> str:
    """Three significant digits, trailing zeros kept (whole numbers from 100 up, never an
    exponent): a sparse trace's goodput (a few requests a minute) is 0.0417/s, which two
    decimals print as 0.04, or over a day-long gap as 0.00; a short run's GPU-hours were
    0.00; and a goodput of 1.0 printed as a bare 1 beside 0.964."""
    if x is None:
        return "-"
    rounded = float(f"{x:.3g}")  # 0.9996 is 1.00, and 99.96 is 100
    if abs(rounded) >= 100 or not math.isfinite(x):
        return f"{x:.0f}"
    return f"{rounded:.{2 if x == 0 else 2 - math.floor(math.log10(abs(rounded)))}f}"


def table(runs: Sequence[Run]) -> list[str]:
    tiers = [t.name for t in ALL_TIERS]
    head = ["router", "scaling", "GPU-h to last arrival", "GPU-h", "GPU-h to last end", "ended at"]
    head += [f"{t} SLO" for t in tiers]
    head += [f"{t} goodput/s" for t in tiers]
    head += ["retried", "lost", "refused"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s = r["summary"]
        refused = sum(v for k, v in s["outcomes"].items() if k.startswith("refused:"))
        cells = [r["router"], r["scaling"], rate_text(s.get("gpu_hours_arrivals"))]
        cells += [rate_text(s["gpu_hours"]), rate_text(s["gpu_hours_common"])]
        cells.append(_s(s["duration_s"]))
        cells += [_pct(s["tiers"][t]["slo_attainment"]) for t in tiers]
        cells += [rate_text(s["tiers"][t]["goodput_rps"]) for t in tiers]
        cells += [str(s["num_retried"]), str(s["num_lost"]), str(refused)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def outcomes_table(runs: Sequence[Run]) -> list[str]:
    """Where every request went, and the tiers' TTFT at the gateway."""
    head = ["router", "scaling", "replicas launched", "CPU s", "P0 TTFT p50 / p99", "P1 TTFT p50 / p99"]
    head += ["P2 TTFT p50", "P3 TTFT p50", "outcomes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        s, tiers = r["summary"], r["summary"]["tiers"]
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(s["outcomes"].items(), key=lambda kv: -kv[1]))
        cells = [r["router"], r["scaling"], str(s["num_replicas_launched"]), f"{r['cpu_s']:.1f}"]
        cells += [f"{_s(tiers[t]['ttft_p50_s'])} / {_s(tiers[t]['ttft_p99_s'])}" for t in ("P0", "P1")]
        cells += [_s(tiers[t]["ttft_p50_s"]) for t in ("P2", "P3")]
        cells.append(outcomes or "none")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _targets(runs: Sequence[Run]) -> str:
    """The tiers' TTFT targets, as the runs judged them: "P0 0.5 s, ..., P3 none"."""
    if not runs:
        return "-"
    tiers = runs[0]["summary"]["tiers"]
    return ", ".join(
        f"{t} {_s(tiers[t].get('ttft_target_s')) if tiers[t].get('ttft_target_s') else 'none'}" for t in tiers
    )


def _s(seconds: float | None) -> str:
    """Three significant digits, and whole seconds with thousands separators from 1,000 s
    up (a trace's hour read 3.48e+03 s)."""
    if seconds is None:
        return "-"
    rounded = float(f"{seconds:.3g}")  # 999.5 is 1,000 s, not 1e+03 s
    return f"{seconds:,.0f} s" if abs(rounded) >= 1000 else f"{seconds:.3g} s"


# One style a run, so that runs whose curves coincide (fixed fleets of the same size, tiers
# at 100 %) still show each: the colour cycle alone drew only the last one.
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "x")


def _style(i: int) -> dict[str, Any]:
    """The i-th run's line: its own dashes and marker, and thinner than the runs before it,
    so that a later line drawn over an earlier one leaves the earlier one's edges showing."""
    return {
        "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
        "marker": _MARKERS[i % len(_MARKERS)],
        "linewidth": max(0.8, 2.8 - 0.5 * i),
    }


def _legend_below(fig: Any) -> None:
    """One legend for the figure, under its panels: inside them it covered the curves'
    ends, where scaling in shows."""
    handles, labels = fig.axes[0].get_legend_handles_labels()
    ncol = min(len(labels), 4) or 1
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    rows = math.ceil(len(labels) / ncol)
    fig.tight_layout(rect=(0.0, 0.04 + 0.05 * rows, 1.0, 1.0))


def _scaled(meta: Mapping[str, Any]) -> str:
    if meta.get("scale_by") == "copies":
        return f"by copies (its {meta['num_trace_rows']} rows over its own span)"
    return "in time (each row once, timestamps divided by the scale)"


def _cut_lines(meta: Mapping[str, Any]) -> list[str]:
    cut = meta.get("num_rows_cut_to_context")
    if not cut:
        return []
    return [
        f"**{cut} of the trace's {meta['num_trace_rows']} rows {'was' if cut == 1 else 'were'} cut to fit "
        "the model's context** "
        f"({meta['max_model_len']} tokens: the output to at most half of it, the prompt to the rest).",
        "",
    ]


def _warning_lines(meta: Mapping[str, Any]) -> list[str]:
    """What the trace loader warned of (a unit that looks misread, rows skipped), kept here."""
    warned = meta.get("input_warnings") or []
    return ["**Warnings:**", "", *(f"- {w}" for w in warned), ""] if warned else []


def write_report(path: Path, meta: Mapping[str, Any], runs: Sequence[Run], plots: Sequence[str]) -> None:
    num = meta["num_requests"]
    lines = [
        "# Fleet simulation",
        "",
        f"Trace `{meta['trace']}` x {meta['rate_scale']} {_scaled(meta)} "
        f"({num} request{'' if num == 1 else 's'}), "
        f"{meta['replicas']} replica{'' if meta['replicas'] == 1 else 's'} of {meta['model']} "
        f"on {meta['tp']} x {meta['gpu']} "
        f"(engine policy {meta['policy']}); commit {meta['commit'] or 'unknown (not a git checkout)'}; "
        f"start-up delay {meta['startup_delay_s']:.0f} s; CPU {meta['cpu_s']:.1f} s.",
        "",
        *_cut_lines(meta),
        *_warning_lines(meta),
        f"SLO attainment: TTFT at the gateway within the tier's target ({_targets(runs)}) and completed.",
        "Goodput: attaining requests per second. GPU-hours include model loading: `GPU-h to last "
        "arrival` from the start to the trace's last arrival, the same window for every run (the "
        "fairest comparison of what the fleets cost while the traffic came); `GPU-h` to the "
        "run's own end (the same run costs the same whatever runs beside it), `GPU-h to last end` "
        f"to the latest run's end ({_s(runs[0]['summary']['common_end_s']) if runs else '-'}) for "
        "every run, for comparing them: after a run that ended sooner (its last request served "
        "or refused sooner) its fleet stands on idle until then, as its autoscaler would keep it "
        "(a fixed fleet whole, an autoscaling one scaling in). TTFT percentiles are over the requests "
        "that got a first token (lost ones included: they had one; refused ones are counted in "
        "the outcomes and in the SLO attainment, not in them).",
        "",
        *table(runs),
        "",
        "Every request sent is in the outcomes: completed, refused by the gateway (with its reason), "
        "shed or rejected by an engine, lost with its replica after its first token, or unfinished "
        f"when the run ended ({meta.get('drain_timeout_s', FleetConfig.drain_timeout_s):g} s after the "
        "last arrival).",
        "",
        *outcomes_table(runs),
        "",
    ]
    for r in runs:
        if why := r["summary"].get("goodput_unmeasured"):
            lines += [
                f"Goodput not measured ({r['router']} / {r['scaling']}): {why}; a longer trace measures it.",
                "",
            ]
    speeds = [
        f"{r['router']} / {r['scaling']} {r['cpu_s']:.1f} CPU-s "
        f"({r['requests_per_cpu_s']:.0f} requests per CPU-s)"
        for r in runs
        if r.get("requests_per_cpu_s")
    ]
    if speeds:
        lines += [f"Simulation ({meta['sim_mode']} mode): " + "; ".join(speeds) + ".", ""]
    for r in runs:
        if said := faults_text(r):
            lines += [f"Replica faults ({r['router']} / {r['scaling']}): {said}.", ""]
    lines += [f"![{p}]({p})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


def faults_text(run: Run) -> str:
    """What each --kill did in `run` ("" for none): an autoscaling fleet may not have
    launched the replica by then, and a kill after the run's end does nothing."""
    return "; ".join(f"replica {i} at {t:g} s: {what}" for t, i, what in run["summary"].get("faults") or ())


def _time_unit(runs: Sequence[Run]) -> tuple[str, float]:
    """The plots' time unit: seconds, or hours for a run of more than three (a days-long
    trace's six-digit seconds ran into each other under the narrow per-tier plots)."""
    end = max((x[0] for r in runs for x in r["summary"]["replicas_over_time"]), default=0.0)
    return ("h", 3600.0) if end > 3 * 3600.0 else ("s", 1.0)


def write_plots(out: Path, runs: Sequence[Run]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, per = _time_unit(runs)
    names = [
        _plot_over_time(plt, out, runs, key, label, unit, per)
        for key, label in (("slo_attainment", "SLO attainment"), ("goodput_rps", "goodput (req/s)"))
    ]
    _plot_replicas(plt, out, runs, unit, per)
    return [*names, "replicas_gpu_hours.png"]


def _plot_over_time(
    plt: Any, out: Path, runs: Sequence[Run], key: str, label: str, unit: str, per: float
) -> str:
    """`key` of every tier over arrival time, one panel a tier; returns the file's name."""
    # One time axis for the four tiers: a tier without requests gets the others' axis,
    # not an empty one around zero.
    fig, axes = plt.subplots(
        1, len(ALL_TIERS), figsize=(4.2 * len(ALL_TIERS), 3.4), squeeze=False, sharex=True
    )
    for ax, tier in zip(axes.flat, ALL_TIERS, strict=True):
        for i, r in enumerate(runs):
            ot = r["summary"]["over_time"]
            ys = ot["tiers"].get(tier.name, {}).get(key, [])
            # A bin without requests is a gap, not a line drawn across it, and a marker on
            # each bin: a run within one bin was an empty panel.
            pts = list(zip(ot["t_s"], ys, strict=False))
            ax.plot(
                [t / per for t, _ in pts],
                [math.nan if y is None else y for _, y in pts],
                markersize=3,
                label=f"{r['router']} / {r['scaling']}",
                **_style(i),
            )
        ax.set_title(f"{tier.name} {label}")
        if key == "slo_attainment":
            ax.set_ylim(-0.02, 1.02)
        else:
            ax.set_ylim(bottom=0)  # a rate from zero: a dip of a tenth is not drawn as a fall
        ax.set_xlabel(f"arrival time ({unit})")
    _legend_below(fig)
    name = f"{key}_over_time.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def _plot_replicas(plt: Any, out: Path, runs: Sequence[Run], unit: str, per: float) -> None:
    """Replicas over time beside each run's GPU-hours, into replicas_gpu_hours.png."""
    from matplotlib.ticker import MaxNLocator

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, max(3.6, 0.3 * len(runs) + 1.2)))
    for i, r in enumerate(runs):
        rot = r["summary"]["replicas_over_time"]
        style = _style(i)
        times = [x[0] / per for x in rot]
        (line,) = ax1.step(
            times,
            [x[1] + x[2] for x in rot],
            where="post",
            label=f"{r['router']} / {r['scaling']}",
            linestyle=style["linestyle"],
            linewidth=style["linewidth"],
        )
        if any(x[2] for x in rot):
            # Those serving, thin, in the run's colour: the gap above is replicas starting,
            # which hold their GPUs but serve nothing (one line for both hid the start-up).
            serving = [x[1] for x in rot]
            ax1.step(times, serving, where="post", color=line.get_color(), linewidth=0.8, alpha=0.6)
    ax1.set_title("replicas holding GPUs (thin: of them serving; the gap, starting)", fontsize=9)
    ax1.set_xlabel(f"time ({unit})")
    # Whole replicas from zero: a fleet of a constant 2 was drawn on an axis of 1.900 to 2.100.
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))
    most = max((x[1] + x[2] for r in runs for x in r["summary"]["replicas_over_time"]), default=1)
    ax1.set_ylim(0, max(1, most) * 1.15)  # room above the top line
    # Horizontal bars: one label a row stays readable for all twelve router x scaling runs.
    labels = [f"{r['router']} / {r['scaling']}" for r in runs]
    rows = range(len(runs))
    common = [r["summary"]["gpu_hours_common"] for r in runs]
    ax2.barh(rows, common, color="0.85")
    ax2.barh(rows, [r["summary"]["gpu_hours"] for r in runs], height=0.5, color="0.35")
    # To the last arrival, the same window for every run (the report's fairest figure): a mark.
    arrivals = [(i, r["summary"].get("gpu_hours_arrivals")) for i, r in zip(rows, runs, strict=True)]
    marked = [(i, x) for i, x in arrivals if x is not None]
    if marked:
        xs, ys = [x for _, x in marked], [i for i, _ in marked]
        ax2.scatter(xs, ys, marker="|", s=300, linewidths=2, color="tab:red", zorder=3)
    ax2.set_yticks(rows, labels, fontsize=7)
    ax2.invert_yaxis()  # the first run on top, as in the tables
    # Said in the title: a legend on the axes sat on the bars' ends, the figures compared.
    ax2.set_title(
        "GPU-hours: to its own end (dark), to the latest run's end (light),\nto the last arrival (red |)",
        fontsize=9,
    )
    _legend_below(fig)
    fig.savefig(out / "replicas_gpu_hours.png", dpi=90)
    plt.close(fig)
