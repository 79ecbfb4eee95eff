"""Runs side by side in one `bench fleet` report are taken over the same window and by the
same rule: GPU-hours to the latest end, goodput measured in every run or in none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tierserve.cli import main
from tierserve.fleet.autoscaler import AutoscaleConfig, ScalingPolicy
from tierserve.fleet.summary import align


def _scaling(idle_s: float = 60.0) -> Any:
    """The runs' autoscaler settings: 1 to 32 replicas, a tick every 15 s, 60 s start-up."""
    return lambda scaling: AutoscaleConfig(
        ScalingPolicy(scaling), min_replicas=1, max_replicas=32, startup_delay_s=60.0, idle_s=idle_s
    )


def _run(
    router: str, end_s: float, replicas_at_end: int, unmeasured: str | None = None, scaling: str = "fixed"
) -> dict[str, Any]:
    gpus = 8
    tiers = {t: {"goodput_rps": None if unmeasured else 1.5} for t in ("P0", "P1", "P2", "P3")}
    over_time = {t: {"goodput_rps": [None if unmeasured else 1.0] * 2} for t in tiers}
    summary = {
        "duration_s": end_s,
        "last_arrival_s": 100.0,
        "gpu_hours": replicas_at_end * gpus * end_s / 3600,
        "replicas_at_end": [replicas_at_end, 0],
        "replicas_over_time": [[0.0, replicas_at_end, 0], [end_s, replicas_at_end, 0]],
        "goodput_unmeasured": unmeasured,
        "tiers": tiers,
        "over_time": {"tiers": over_time},
    }
    return {"router": router, "scaling": scaling, "summary": summary}


def test_a_fixed_fleet_costs_the_same_gpu_hours_whichever_router_ended_first() -> None:
    """A router that refused requests ended its run sooner, and its fixed fleet of the same
    two replicas read as 0.410 GPU-h against round-robin's 1.02."""
    runs = [_run("round-robin", 439.4, 2), _run("tier-aware", 164.5, 2)]
    align(runs, 8, _scaling())
    hours = [r["summary"]["gpu_hours_common"] for r in runs]
    assert hours[0] == pytest.approx(hours[1]) == pytest.approx(2 * 8 * 439.4 / 3600)
    assert all(r["summary"]["common_end_s"] == 439.4 for r in runs)
    assert runs[1]["summary"]["gpu_hours"] == pytest.approx(2 * 8 * 164.5 / 3600)  # its own, kept


@pytest.mark.parametrize(
    ("serving", "idle_s", "replica_s"),
    [
        # Ticks at 510, 525, ...: calm from 510, three out at 570, down to 1 (one a period of
        # 60 s, at 570, 630 and 690, before the autoscaler scaled in to the load's size).
        (4, 60.0, 4 * 70 + 1 * 430),
        # No idle time: down to 1 at the first tick.
        (4, 0.0, 4 * 10 + 1 * 490),
        # Under its minimum (a replica died): one is launched at the first tick.
        (0, 60.0, 1 * 490),
    ],
)
def test_an_autoscaling_fleet_idles_after_its_end_as_its_autoscaler_scales_it(
    serving: int, idle_s: float, replica_s: float
) -> None:
    """Kept whole to the common end, an autoscaled fleet was charged for every replica it had
    at its end; scaled in at once (no ticks), for less than its autoscaler would spend."""
    runs = [_run("tier-aware", 1000.0, 2), _run("tier-aware", 500.0, serving, scaling="tier")]
    align(runs, 8, _scaling(idle_s))
    own = runs[1]["summary"]["gpu_hours"]
    assert runs[1]["summary"]["gpu_hours_common"] == pytest.approx(own + replica_s * 8 / 3600)
    assert runs[0]["summary"]["gpu_hours_common"] == pytest.approx(2 * 8 * 1000 / 3600)


def test_goodput_is_measured_in_every_run_of_a_report_or_in_none() -> None:
    runs = [_run("round-robin", 60.0, 2, unmeasured="a burst"), _run("tier-aware", 50.0, 2)]
    align(runs, 8, _scaling())
    aware = runs[1]["summary"]
    assert aware["goodput_unmeasured"] == "not measured in round-robin / fixed: a burst"
    assert all(t["goodput_rps"] is None for t in aware["tiers"].values())
    assert all(v is None for t in aware["over_time"]["tiers"].values() for v in t["goodput_rps"])
    measured = [_run("round-robin", 60.0, 2), _run("tier-aware", 50.0, 2)]
    align(measured, 8, _scaling())
    assert all(r["summary"]["goodput_unmeasured"] is None for r in measured)
    assert all(r["summary"]["tiers"]["P0"]["goodput_rps"] == 1.5 for r in measured)


def test_the_bench_writes_gpu_hours_to_a_common_end_and_says_lost_requests_have_a_ttft(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A burst two replicas cannot keep up with: the gateway refuses part of it, so the runs end
    # at different times.
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:00:{i * 0.05:010.7f},2000,300" for i in range(120)]
    trace = tmp_path / "burst.csv"
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    argv = ["bench", "fleet", "--replicas", "2", "--trace", str(trace), "--router", "round-robin,tier-aware"]
    assert main([*argv, "--out", str(out)]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    ends = [r["summary"]["duration_s"] for r in runs]
    assert ends[0] != ends[1]
    for r in runs:
        s = r["summary"]
        assert s["common_end_s"] == max(ends) and s["replicas_at_end"] == [2, 0]
        assert s["gpu_hours_common"] == pytest.approx(2 * 8 * max(ends) / 3600)
    assert len({bool(r["summary"]["goodput_unmeasured"]) for r in runs}) == 1
    report = (out / "report.md").read_text()
    assert "lost ones included" in report and "refused and lost ones are counted" not in report
    assert "as its autoscaler would keep it" in report
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[-1] == "other"


def test_the_drain_timeout_is_a_flag_and_what_it_cuts_is_unfinished(tmp_path: Path) -> None:
    """It was 600 s, fixed: a user could not give a long answer the time to end."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:00:{i * 0.5:010.7f},500,2000" for i in range(10)]
    trace = tmp_path / "long_answers.csv"
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["bench", "fleet", "--trace", str(trace), "--drain-timeout-s", "5", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["drain_timeout_s"] == 5.0
    summary = results["runs"][0]["summary"]
    assert summary["outcomes"].get("unfinished", 0) == 10  # 2,000 tokens take far longer than 5 s
    assert summary["duration_s"] == pytest.approx(4.5 + 5.0)
    assert "(5 s after the last arrival)" in (out / "report.md").read_text()


def test_gpu_hours_to_the_last_arrival_are_over_the_same_window_in_every_run() -> None:
    """To the latest end, a fleet that scaled in early paid for the idle tail the slowest run
    left (a fixed fleet draining its unfinished requests): 6.15 GPU-h to its own end read as
    21.0. To the last arrival, each run's own curve over the same window."""
    fixed = _run("round-robin", 900.0, 4)
    scaled = _run("tier-aware", 300.0, 1, scaling="tier")
    # 4 replicas until 60 s, 2 until 150 s, 1 after: the curve the run recorded.
    scaled["summary"]["replicas_over_time"] = [[0.0, 4, 0], [60.0, 2, 0], [150.0, 1, 0], [300.0, 1, 0]]
    runs = [fixed, scaled]
    for r in runs:
        r["summary"]["last_arrival_s"] = 120.0
    align(runs, 8, _scaling())
    assert fixed["summary"]["gpu_hours_arrivals"] == pytest.approx(4 * 8 * 120 / 3600)
    assert scaled["summary"]["gpu_hours_arrivals"] == pytest.approx((4 * 60 + 2 * 60) * 8 / 3600)
