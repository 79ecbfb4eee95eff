"""`tierserve bench sim-speed`: both modes on one small cell, the figures the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierserve.cli import main


def test_sim_speed_reports_both_rates_and_no_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim-speed.json"
    argv = ["bench", "sim-speed", "--load", "8", "--requests", "20", "--repeats", "2", "--json"]
    assert main([*argv, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    # A line as each repeat starts, on stderr: the JSON on stdout stays whole.
    assert [line for line in captured.err.splitlines() if line.startswith("[bench sim-speed] repeat")] == [
        "[bench sim-speed] repeat 1 of 2: step mode, then fast ...",
        "[bench sim-speed] repeat 2 of 2: step mode, then fast ...",
    ]
    assert printed == json.loads(out.read_text())
    assert printed["max_rel_diff"] == 0.0 and printed["mismatches"] == 0
    assert printed["step_requests_per_cpu_s"] > 0 and printed["fast_requests_per_cpu_s"] > 0
    rate_ratio = printed["fast_requests_per_cpu_s"] / printed["step_requests_per_cpu_s"]
    assert printed["speedup"] == pytest.approx(rate_ratio, rel=0.01)
    assert 0 < printed["leapt_share"] < 1 and printed["num_requests"] >= 20
    # Prompts run in full steps beside the kept decoders (admissions need a full step).
    assert 0 < printed["kept_share"] <= 1 - printed["leapt_share"]


def test_sim_speed_refuses_a_load_of_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sim-speed", "--load", "0"]) == 2
    assert "--load must be > 0" in capsys.readouterr().err


def _trace(tmp_path: Path, num_rows: int) -> Path:
    rows = "".join(
        f'{{"timestamp": {i * 400}, "input_length": 300, "output_length": 20}}\n' for i in range(num_rows)
    )
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "t.jsonl"
    path.write_text(rows)
    return path


def test_a_trace_file_replays_at_its_own_timestamps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not 256 closed-loop clients, whose warm-up (one request each) took every row of a
    small trace and left nothing measured."""
    argv = ["bench", "sim-speed", "--workload", str(_trace(tmp_path, 60)), "--repeats", "1", "--json"]
    assert main([*argv, "--out", str(tmp_path / "out.json")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["pattern"] == "trace" and printed["load"] == 1.0
    assert printed["num_requests"] == 60 and printed["num_measured"] > 0


def test_a_trace_that_runs_out_before_the_requests_asked_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--trace-rows 50 --requests 100` measured 45 without a word (a new user's trial)."""
    argv = ["bench", "sim-speed", "--workload", str(_trace(tmp_path, 60)), "--repeats", "1", "--json"]
    assert main([*argv, "--requests", "100", "--out", ""]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    measured, warm_up = printed["num_measured"], printed["num_requests"] - printed["num_measured"]
    assert measured < 100
    assert f"note: {measured} requests measured of the 100 asked" in captured.err
    # a warm-up named only where requests ran as one ("2 measured ... the first requests are a
    # warm-up" read beside num_measured 2 of 2)
    assert (f"({warm_up} more ran first as a warm-up, not measured)" in captured.err) == (warm_up > 0)
    assert main([*argv, "--requests", str(measured), "--out", ""]) == 0
    assert "note:" not in capsys.readouterr().err
    two = ["bench", "sim-speed", "--workload", str(_trace(tmp_path / "two", 2)), "--repeats", "1", "--json"]
    assert main([*two, "--out", ""]) == 0
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed["num_measured"] == printed["num_requests"] and "warm-up" not in captured.err


def test_a_trace_run_says_what_it_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seconds read as milliseconds cannot be told from the rows: the span read is printed."""
    trace = _trace(tmp_path, 11)  # 400 ms apart: 4 s in all
    argv = ["bench", "sim-speed", "--workload", str(trace), "--repeats", "1", "--json"]
    assert main([*argv, "--out", ""]) == 0
    assert f"{trace}: 11 rows arriving over 4 s (2.5 requests/s at 1x)" in capsys.readouterr().err


def test_a_trace_refuses_the_closed_loop_and_a_synthetic_workload_the_trace_pattern(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(_trace(tmp_path, 5))
    assert main(["bench", "sim-speed", "--workload", trace, "--pattern", "closed"]) == 2
    assert "is a trace, replayed at its own timestamps" in capsys.readouterr().err
    assert main(["bench", "sim-speed", "--pattern", "trace"]) == 2
    assert "default is not a trace file" in capsys.readouterr().err


def test_a_trace_slowed_past_ten_years_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(_trace(tmp_path, 60))
    out = tmp_path / "out.json"
    assert main(["bench", "sim-speed", "--workload", trace, "--load", "1e-12", "--out", str(out)]) == 2
    assert "days at 1e-12 times its rate; at most 3,650.0 days" in capsys.readouterr().err
    assert not out.exists()


def test_rows_cut_to_the_context_are_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench fleet` said it; `bench sim-speed` said nothing (a new user's trial)."""
    trace = tmp_path / "huge.jsonl"
    rows = [(i * 400, 10_000_000 if i == 3 else 300, 20) for i in range(20)]
    trace.write_text(
        "".join(f'{{"timestamp": {t}, "input_length": {p}, "output_length": {o}}}\n' for t, p, o in rows)
    )
    argv = ["bench", "sim-speed", "--workload", str(trace), "--repeats", "1", "--json", "--out", ""]
    assert main(argv) == 0
    assert "note: 1 of the trace's 20 rows was cut to the model's context" in capsys.readouterr().err
