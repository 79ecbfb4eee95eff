"""The reproduce report's plots show every policy: the legend stays inside the figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest

from tierserve.bench.plots import plot_against_load, short_names
from tierserve.scheduling.registry import BENCH_POLICIES, POLICIES


def _run(policy: str, workload: str) -> dict[str, Any]:
    return {"policy": policy, "workload": workload, "pattern": "poisson", "arrival": "open", "load": 1.0}


@pytest.mark.parametrize(
    ("policies", "workloads"),
    [(BENCH_POLICIES, ["default"]), (tuple(POLICIES), ["default", "memory-pressure"])],
)
def test_the_legend_of_a_one_or_two_panel_figure_shows_every_policy(
    policies: tuple[str, ...], workloads: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one row of every policy, a one-panel figure (`--workloads default --patterns
    poisson`) cut off the first and last policies of the five it compares."""
    figs: list[Any] = []
    monkeypatch.setattr(plt, "close", figs.append)
    runs = [_run(p, w) for w in workloads for p in policies]
    plot_against_load(tmp_path / "p0.png", runs, "P0 SLO attainment", lambda r: 1.0, fraction=True)
    (fig,) = figs
    (legend,) = fig.legends
    renderer = fig.canvas.get_renderer()
    box, panel = legend.get_window_extent(renderer), fig.axes[0].get_tightbbox(renderer)
    assert [t.get_text() for t in legend.get_texts()] == list(policies)
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width and box.y0 >= 0
    assert box.y1 <= panel.y0  # below the panels and their labels, covering no data


def test_panels_of_two_traces_named_alike_are_told_apart_by_their_folders() -> None:
    """Two traces called conv.csv in two folders had panels titled the same."""
    names = short_names(["default", "/data/a/conv.csv", "/data/b/conv.csv", "/data/b/code.csv"])
    assert names == {
        "default": "default",
        "/data/a/conv.csv": "a/conv.csv",
        "/data/b/conv.csv": "b/conv.csv",
        "/data/b/code.csv": "code.csv",
    }
