"""Figures against load: a panel per (workload, arrival pattern), a line per policy, the
legend below the panels so that it covers no data."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Run = Mapping[str, Any]
MARKERS = "os^Dvx*P"
STYLES = ("-", "--", ":", "-.")


def plot_against_load(
    path: Path,
    runs: Sequence[Run],
    ylabel: str,
    value: Callable[[Run], float | None],
    fraction: bool = False,
) -> None:
    """`fraction`: the values are shares, drawn on a 0-100 % axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = list(dict.fromkeys((r["workload"], r["pattern"]) for r in runs))
    names = short_names([w for w, _ in sections])
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    cols = min(3, len(sections))
    rows = math.ceil(len(sections) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows + 0.8), squeeze=False)
    for ax, (workload, pattern) in zip(axes.flat, sections, strict=False):
        cells = [r for r in runs if r["workload"] == workload and r["pattern"] == pattern]
        loads = list(dict.fromkeys(r["load"] for r in cells))
        for k, policy in enumerate(policies):
            ys = [
                next((value(r) for r in cells if r["load"] == x and r["policy"] == policy), None)
                for x in loads
            ]
            ax.plot(
                range(len(loads)),
                [math.nan if y is None else y for y in ys],
                label=policy,
                marker=MARKERS[k % len(MARKERS)],
                markersize=11 - 1.5 * (k % 4),  # hollow, shrinking: equal points stay visible
                fillstyle="none",
                markeredgewidth=1.6,
                linestyle=STYLES[k % len(STYLES)],
                alpha=0.85,
            )
        closed = cells[0]["arrival"] == "closed"
        ax.set_xticks(range(len(loads)), [f"{x:g}" for x in loads])
        ax.set_xlabel(
            "clients" if closed else ("trace speed-up" if pattern == "trace" else "load (x capacity)")
        )
        ax.set_title(f"{names[workload]}, {pattern}")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if fraction:
            ax.set_ylim(-0.06, 1.06)  # room for the largest hollow marker at 0 and at 1
        else:
            # From 0 (differences in proportion to the whole), with room above the highest
            # marker: at the default 5 % its top was clipped.
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.06)
    for ax in list(axes.flat)[len(sections) :]:
        ax.set_visible(False)
    legend_in = _legend_below(fig, *axes.flat[0].get_legend_handles_labels())
    fig.set_size_inches(fig.get_size_inches()[0], 3.6 * rows + legend_in)
    fig.tight_layout(rect=(0, legend_in / (3.6 * rows + legend_in), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def short_names(workloads: Sequence[str]) -> dict[str, str]:
    """Each workload's name for a panel title: a trace's file name, not its path (a full path
    ran off the panel), with as many of its folders as tell it from the others (two traces
    named alike in two folders had panels titled the same)."""

    def tail(workload: str, n: int) -> str:
        return str(Path(*Path(workload).parts[-n:]))

    names: dict[str, str] = {}
    for workload in dict.fromkeys(workloads):
        others = [w for w in workloads if w != workload]
        n = 1
        while n < len(Path(workload).parts) and any(tail(w, n) == tail(workload, n) for w in others):
            n += 1
        names[workload] = tail(workload, n)
    return names


def _legend_below(fig: Any, handles: list[Any], labels: list[str]) -> float:
    """Put the legend below the panels in as many columns as the figure's width holds (one
    row of every policy ran off both sides of a one- or two-panel figure, hiding the first
    and last policies); return the height in inches to keep for it."""
    renderer = fig.canvas.get_renderer()
    for ncol in range(len(labels), 0, -1):
        legend = fig.legend(handles, labels, loc="lower center", ncol=ncol, frameon=False)
        box = legend.get_window_extent(renderer)
        if box.width <= fig.bbox.width or ncol == 1:
            return 0.45 + float(box.height) / float(fig.dpi)
        legend.remove()
    return 0.8  # no policy: nothing to show
