"""The fleet report's plots and table read as a planner needs: whole replicas from zero, one time axis
for the four tiers, hours for a days-long run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest

from tierserve.fleet.report import table, write_plots


def _run(end_s: float, replicas: int) -> dict[str, Any]:
    """A run's summary as the plots read it: P1 requests in the first and last bins only."""
    t_s = [0.0, end_s - 60.0]
    none: list[float | None] = [None, None]
    tiers = {t: {"slo_attainment": none, "goodput_rps": none} for t in ("P0", "P2", "P3")}
    tiers["P1"] = {"slo_attainment": [1.0, 0.5], "goodput_rps": [2.0, 1.0]}
    summary = {
        "over_time": {"bin_s": 60.0, "t_s": t_s, "tiers": tiers},
        "replicas_over_time": [[0.0, replicas, 0], [end_s, replicas, 0]],
        "gpu_hours": replicas * 8 * end_s / 3600,
        "gpu_hours_common": replicas * 8 * end_s / 3600,
        "common_end_s": end_s,
    }
    return {"router": "tier-aware", "scaling": "fixed", "summary": summary}


def _figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run: dict[str, Any]) -> list[Any]:
    """The figures `write_plots` draws, kept from `plt.close`."""
    figs: list[Any] = []
    monkeypatch.setattr(plt, "close", figs.append)
    write_plots(tmp_path, [run])
    return figs


def test_the_replica_count_is_drawn_in_whole_replicas_from_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    *_, replicas_fig = _figures(tmp_path, monkeypatch, _run(140.0, 2))
    ax = replicas_fig.axes[0]
    ticks = [t for t in ax.get_yticks() if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > 2
    assert all(t == int(t) for t in ticks)  # not 1.900, 1.925, ... around a fleet of 2


def test_a_days_long_run_is_drawn_in_hours_on_one_axis_for_every_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slo_fig, goodput_fig, replicas_fig = _figures(tmp_path, monkeypatch, _run(3 * 86_400.0, 2))
    for fig in (slo_fig, goodput_fig):
        p0, p1, *_ = fig.axes
        assert p1.get_xlabel() == "arrival time (h)"
        assert p0.get_xlim() == p1.get_xlim()  # P0 had no requests: its axis is P1's, not one near zero
        assert p1.get_xlim()[1] < 100
    assert replicas_fig.axes[0].get_xlabel() == "time (h)"
    # A short run stays in seconds.
    plt_figs = _figures(tmp_path, monkeypatch, _run(140.0, 2))
    assert plt_figs[0].axes[1].get_xlabel() == "arrival time (s)"


@pytest.mark.parametrize(("gpu_hours", "shown"), [(0.0031, "0.00310"), (2.345, "2.35"), (1234.5, "1234")])
def test_the_table_shows_gpu_hours_to_three_significant_digits(gpu_hours: float, shown: str) -> None:
    """Two decimals printed a short run's GPU-hours as 0.00."""
    summary: dict[str, Any] = {
        "gpu_hours": gpu_hours,
        "gpu_hours_common": gpu_hours,
        "gpu_hours_arrivals": gpu_hours,
        "duration_s": 60.0,
        "tiers": {t: {"slo_attainment": None, "goodput_rps": 0.0} for t in ("P0", "P1", "P2", "P3")},
        "outcomes": {},
        "num_retried": 0,
        "num_lost": 0,
    }
    row = table([{"router": "tier-aware", "scaling": "fixed", "summary": summary}])[-1]
    assert row.split(" | ")[2] == row.split(" | ")[3] == row.split(" | ")[4] == shown


def test_a_bin_without_requests_is_a_gap_and_a_lone_bin_is_drawn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bins without requests were dropped and a plain line drawn through the rest: across
    an empty bin it drew a trend nobody measured, and a run within one bin drew nothing."""
    run = _run(240.0, 2)
    over_time = run["summary"]["over_time"]
    over_time["t_s"] = [0.0, 60.0, 120.0, 180.0]
    over_time["tiers"]["P1"] = {"slo_attainment": [0.75, None, None, 1.0], "goodput_rps": [1.0] * 4}
    over_time["tiers"]["P3"] = {"slo_attainment": [None, None, None, 1.0], "goodput_rps": [0.5] * 4}
    slo_fig, *_ = _figures(tmp_path, monkeypatch, run)
    (p1_line,) = slo_fig.axes[1].get_lines()
    ys = [float(y) for y in p1_line.get_ydata()]
    assert ys[0] == 0.75 and ys[3] == 1.0 and all(y != y for y in ys[1:3])  # NaN: no line between
    (p3_line,) = slo_fig.axes[3].get_lines()
    assert p3_line.get_marker() not in (None, "None", "", " ")  # one point, still seen


def test_seconds_in_the_report_never_take_an_exponent() -> None:
    """The trace's hour read 3.48e+03 s, and 999.5 s read 1e+03 s."""
    from tierserve.fleet.report import _s

    cases = {999.4: "999 s", 999.5: "1,000 s", 3480.2: "3,480 s", 0.0123: "0.0123 s", None: "-"}
    assert {x: _s(x) for x in cases} == cases
