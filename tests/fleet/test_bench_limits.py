"""`tierserve bench fleet` refuses, before it simulates anything, what could not end in
reasonable time or memory (a fleet of a million replicas, a month of virtual time, millions
of over-time bins, trillions of copies) and a results folder it could not write; and its
report accounts for every request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fleet.test_bench_command import _azure_trace
from tierserve.bench.fleet_bench import MAX_REPLICAS
from tierserve.cli import main
from tierserve.fleet.bench import FleetBench


@pytest.fixture
def never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a fleet is simulated: these arguments must be refused first."""

    def run(*args: object) -> None:
        raise AssertionError("the fleet was simulated before the arguments were refused")

    monkeypatch.setattr(FleetBench, "run", run)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--replicas", str(MAX_REPLICAS + 1)], f"--replicas {MAX_REPLICAS + 1}: at most {MAX_REPLICAS}"),
        (["--autoscale", "--max-replicas", "1000000000"], "--max-replicas 1000000000: at most"),
        (["--autoscale", "tier", "--scale-interval-s", "0.000001"], "decide at most that often"),
        (["--rate-scale", "1e-9"], "days of virtual time; at most 31"),
        (["--bin-s", "0.000001"], "bins; at most 100,000: use a wider --bin-s"),
        (["--drain-timeout-s", "1e9"], "--drain-timeout-s must be at most"),
        (["--rate-scale", "1e12", "--scale-by", "copies"], "requests from 40 rows; at most 10,000,000"),
    ],
)
@pytest.mark.usefixtures("never_runs")
def test_runs_that_could_not_end_are_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str
) -> None:
    trace = _azure_trace(tmp_path / "trace.csv", 40, seed=1)
    argv = ["bench", "fleet", "--replicas", "2", "--trace", str(trace), "--out", str(tmp_path / "out")]
    assert main([*argv, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1


def test_an_unknown_policy_is_said_before_the_trace_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was found only when the first engine was built: a missing trace's error came
    instead, and an existing trace was parsed and --out made first."""
    out = tmp_path / "out"
    argv = ["bench", "fleet", "--policy", "bogus", "--out", str(out)]
    assert main([*argv, "--trace", str(tmp_path / "missing.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--policy 'bogus': choose from" in err and "hybrid" in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_a_fixed_fleet_is_not_sized_by_the_autoscalers_bound(tmp_path: Path) -> None:
    """--max-replicas bounds the autoscalers; a fixed fleet of 2 knows only its own replicas'
    names (it built a gateway for 4 x 10^9 upstreams and ran out of memory). Beside a
    scaling run the bound is the autoscaler's; with no scaling run it is refused (it was
    ignored without a word)."""
    trace = _azure_trace(tmp_path / "trace.csv", 10, seed=1)
    argv = ["bench", "fleet", "--replicas", "2", "--trace", str(trace), "--max-replicas", "1000000000"]
    assert main([*argv, "--out", str(tmp_path / "fixed")]) == 2
    assert main([*argv, "--autoscale", "fixed", "--out", str(tmp_path / "fixed")]) == 2
    argv[-1] = "3"
    assert main([*argv, "--autoscale", "fixed,tier", "--out", str(tmp_path / "out")]) == 0
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["runs"]
    assert [sum(r["summary"]["outcomes"].values()) for r in runs] == [10, 10]


@pytest.mark.usefixtures("never_runs")
def test_an_out_that_is_a_file_is_refused_before_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _azure_trace(tmp_path / "trace.csv", 40, seed=1)
    taken = tmp_path / "afile"
    taken.write_text("mine")
    assert main(["bench", "fleet", "--trace", str(trace), "--out", str(taken)]) == 2
    assert f"--out {taken} exists and is not a folder" in capsys.readouterr().err
    assert taken.read_text() == "mine"


def test_requests_sent_at_one_instant_measure_no_goodput(tmp_path: Path) -> None:
    """As in `bench reproduce`: 30 requests at the same timestamp have no arrival span to
    measure a rate over (it used to be divided by the run's length instead)."""
    trace = tmp_path / "burst.csv"
    rows = "\n".join("2023-11-16 18:00:00,2000,100" for _ in range(30))
    trace.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n{rows}\n")
    argv = ["bench", "fleet", "--replicas", "1", "--trace", str(trace)]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 0
    (run,) = json.loads((tmp_path / "o" / "results.json").read_text())["runs"]
    assert "arrived within 0 s" in run["summary"]["goodput_unmeasured"]
    assert all(t["goodput_rps"] is None for t in run["summary"]["tiers"].values())


def test_each_tiers_outcomes_add_up_and_the_report_names_them(tmp_path: Path) -> None:
    """A request an engine sheds or rejects is counted in its tier and in report.md (the tier
    figures had no place for it, and the report showed only retried, lost and refused)."""
    from tierserve.bench.cell import BenchSetup
    from tierserve.fleet.report import write_report
    from tierserve.fleet.requests import COMPLETED, LOST, REJECTED, SHED, FleetRequest
    from tierserve.fleet.sim import FleetResult
    from tierserve.fleet.summary import summarize
    from tierserve.tiers import Tier
    from tierserve.workloads import RequestSpec

    outcomes = [COMPLETED, SHED, REJECTED, LOST, "refused:queue_full", None]
    reqs = []
    for key, outcome in enumerate(outcomes):
        fr = FleetRequest(key, RequestSpec(key, Tier.P3, "t", (1, 2, 3), 4, arrival_s=key), float(key))
        fr.first_token_s, fr.finish_s, fr.outcome = key + 0.5, key + 1.0, outcome
        reqs.append(fr)
    result = FleetResult(reqs, 10.0, 3600.0, [], {}, 1)
    summary = summarize(result, BenchSetup().engine_config(), 60.0)
    p3 = summary["tiers"]["P3"]
    counts = [p3[k] for k in ("num_completed", "num_shed", "num_rejected", "num_lost", "num_refused")]
    assert counts == [1, 1, 1, 1, 1] and p3["num_unfinished"] == 1 and p3["num_requests"] == 6

    run = {"router": "tier-aware", "scaling": "fixed", "cpu_s": 1.0, "requests_per_cpu_s": 6.0}
    meta = {"trace": "t.csv", "rate_scale": 1.0, "num_requests": 6, "replicas": 1, "model": "m", "tp": 8}
    meta |= {"gpu": "g", "policy": "hybrid", "commit": None, "startup_delay_s": 0.0, "cpu_s": 1.0}
    write_report(tmp_path / "report.md", meta | {"sim_mode": "fast"}, [run | {"summary": summary}], [])
    report = (tmp_path / "report.md").read_text()
    assert "| tier-aware | fixed | 1 | 1.0 |" in report
    for said in ("completed 1", "shed 1", "rejected 1", "lost 1", "refused:queue_full 1", "unfinished 1"):
        assert said in report
    assert "commit unknown (not a git checkout)" in report  # outside a checkout: not "commit None"


def test_a_scaling_fleet_takes_a_kill_of_any_replica_and_says_what_it_did(tmp_path: Path) -> None:
    """An autoscaling fleet numbers every launch anew (a replacement, a scale-out after a
    scale-in), so a replica past --max-replicas may exist: such a kill was refused. One never
    launched is reported as such."""
    trace = _azure_trace(tmp_path / "trace.csv", 40, seed=1)
    out = tmp_path / "out"
    argv = ["bench", "fleet", "--replicas", "1", "--trace", str(trace), "--out", str(out)]
    assert main([*argv, "--autoscale", "utilization", "--max-replicas", "2", "--kill", "1@7"]) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["summary"]["faults"] == [[1.0, 7, "not launched"]]
