"""`tierserve bench fleet` end to end, on a small trace the test writes: results.json,
report.md and the plots, two routers side by side, and the simulation's own speed."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from tierserve.bench.fleet_bench import _replayed_line
from tierserve.cli import main
from tierserve.workloads.traces import TraceRecord


def _azure_trace(path: Path, num_rows: int, seed: int) -> Path:
    """An Azure-format trace: `num_rows` requests over ~20 s, 200-3,000-token prompts."""
    rng = random.Random(seed)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    t = 0.0
    for _ in range(num_rows):
        t += rng.expovariate(2.0)
        lines.append(f"2023-11-16 18:00:{t:010.7f},{rng.randint(200, 3000)},{rng.randint(1, 200)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_fleet_writes_results_report_and_plots_for_each_router(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _azure_trace(tmp_path / "trace.csv", 40, seed=1)
    out = tmp_path / "out"
    argv = ["bench", "fleet", "--replicas", "2", "--trace", str(trace), "--router", "round-robin,tier-aware"]
    assert main([*argv, "--out", str(out)]) == 0
    # A line a run on the terminal (it printed only where the files went).
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:5] == ["run", "P0", "P1", "P2", "P3"] and len(table) in (3, 4)
    assert table[1].startswith("round-robin / fixed") and table[2].startswith("tier-aware / fixed")
    assert len(table) == 3 or table[3].startswith("GPU-h: to each run's own end")

    results = json.loads((out / "results.json").read_text())
    meta, runs = results["meta"], results["runs"]
    assert meta["num_requests"] == 40 and meta["replicas"] == 2 and meta["sim_mode"] == "fast"
    # Enough to run it again, autoscaler included (two runs differing in --max-replicas had one meta).
    assert (meta["min_replicas"], meta["max_replicas"]) == (1, 32)
    assert {"scale_interval_s", "idle_s", "bin_s", "startup_delay_s"} <= set(meta)
    assert [(r["router"], r["scaling"]) for r in runs] == [("round-robin", "fixed"), ("tier-aware", "fixed")]
    for run in runs:
        outcomes = run["summary"]["outcomes"]
        assert sum(outcomes.values()) == 40  # every request accounted for
        assert run["cpu_s"] > 0 and run["requests_per_cpu_s"] == 40 / run["cpu_s"]

    report = (out / "report.md").read_text()
    assert "| round-robin | fixed |" in report and "| tier-aware | fixed |" in report
    assert "Simulation (fast mode): round-robin / fixed" in report
    for plot in ("slo_attainment_over_time.png", "goodput_rps_over_time.png", "replicas_gpu_hours.png"):
        assert (out / plot).stat().st_size > 0 and f"]({plot})" in report


def test_what_the_trace_loader_warned_of_is_in_results_and_report(tmp_path: Path) -> None:
    """BurstGPT rows with 0 request tokens are skipped with a warning: it went to stderr only."""
    rows = [f"{i * 0.5},ChatGPT,{0 if i % 10 == 0 else 300},20,320,Conversation log" for i in range(40)]
    trace = tmp_path / "burst.csv"
    header = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"
    trace.write_text("\n".join([header, *rows]) + "\n")
    out = tmp_path / "out"
    assert main(["bench", "fleet", "--replicas", "1", "--trace", str(trace), "--router", "round-robin",
                 "--out", str(out)]) == 0  # fmt: skip
    warned = json.loads((out / "results.json").read_text())["meta"]["input_warnings"]
    assert len(warned) == 1 and "skipped 4 rows with 0 Request tokens" in warned[0]
    assert "**Warnings:**" in (out / "report.md").read_text()


def test_a_trace_scaled_into_a_burst_measures_no_goodput(tmp_path: Path) -> None:
    """40 requests over ~20 s at a billion times their rate arrive within microseconds:
    attained requests over that span would claim millions a second."""
    trace = _azure_trace(tmp_path / "trace.csv", 40, seed=1)
    out = tmp_path / "out"
    argv = ["bench", "fleet", "--replicas", "1", "--trace", str(trace), "--rate-scale", "1e9"]
    assert main([*argv, "--out", str(out)]) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    summary = run["summary"]
    assert "median latency" in summary["goodput_unmeasured"]
    assert all(tier["goodput_rps"] is None for tier in summary["tiers"].values())
    report = (out / "report.md").read_text()
    assert "Goodput not measured (tier-aware / fixed)" in report and "1 replica of" in report
    # At its own rate the same trace measures it.
    assert main([*argv[:-2], "--out", str(tmp_path / "own")]) == 0
    (run,) = json.loads((tmp_path / "own" / "results.json").read_text())["runs"]
    assert run["summary"]["goodput_unmeasured"] is None
    assert run["summary"]["tiers"]["P3"]["goodput_rps"] is not None


def test_scaling_by_copies_sends_that_many_times_the_rows_over_the_trace_span(tmp_path: Path) -> None:
    from tierserve.workloads import load_trace
    from tierserve.workloads.trace_stream import replay_count

    trace = _azure_trace(tmp_path / "trace.csv", 40, seed=2)
    expected = replay_count(load_trace(trace), 0, 2.5, "copies")
    assert 80 <= expected <= 120  # twice each row, a third time for about half of them
    out = tmp_path / "out"
    argv = ["bench", "fleet", "--replicas", "2", "--trace", str(trace), "--rate-scale", "2.5"]
    assert main([*argv, "--scale-by", "copies", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    meta, (run,) = results["meta"], results["runs"]
    assert (meta["scale_by"], meta["num_trace_rows"], meta["num_requests"]) == ("copies", 40, expected)
    assert sum(run["summary"]["outcomes"].values()) == expected  # every copy accounted for
    report = (out / "report.md").read_text()
    assert f"by copies (its 40 rows over its own span) ({expected} requests)" in report
    # Scaled in time (the default) the same trace sends each row once.
    assert main([*argv, "--out", str(tmp_path / "time")]) == 0
    meta = json.loads((tmp_path / "time" / "results.json").read_text())["meta"]
    assert (meta["scale_by"], meta["num_requests"]) == ("time", 40)


def test_copies_that_keep_no_row_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _azure_trace(tmp_path / "trace.csv", 40, seed=2)
    argv = ["bench", "fleet", "--trace", str(trace), "--rate-scale", "1e-6", "--scale-by", "copies"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "keeps none of the trace's 40 rows" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "results.json").exists()


def test_rows_cut_to_fit_the_context_are_counted_in_the_report(tmp_path: Path) -> None:
    """A 200k-token prompt runs shortened to the 131,072-token context: the report says how
    many rows were not replayed as the trace has them."""
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:00:{i:02d}.0,{200_000 if i % 4 == 0 else 500},20" for i in range(12)]
    trace = tmp_path / "long.csv"
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert main(["bench", "fleet", "--replicas", "1", "--trace", str(trace), "--out", str(out)]) == 0
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert meta["num_rows_cut_to_context"] == 3 and meta["max_model_len"] == 131072
    assert (
        "**3 of the trace's 12 rows were cut to fit the model's context**" in (out / "report.md").read_text()
    )


def test_a_sparse_traces_goodput_keeps_its_digits_in_the_report() -> None:
    """A few requests a minute is 0.0417 requests/s: two decimals printed it as 0.04, and
    over a day-long gap every tier read 0.00."""
    from tierserve.fleet.report import table

    tiers = {t: {"slo_attainment": 1.0, "goodput_rps": 0.000694} for t in ("P0", "P1", "P2", "P3")}
    summary = {
        "gpu_hours": 1.0,
        "gpu_hours_common": 1.0,
        "duration_s": 60.0,
        "tiers": tiers,
        "outcomes": {},
        "num_retried": 0,
        "num_lost": 0,
    }
    run = {"router": "tier-aware", "scaling": "fixed", "summary": summary}
    row = next(line for line in table([run]) if line.startswith("| tier-aware"))  # type: ignore[list-item]
    assert row.count("| 0.000694 ") == 4
    # The terminal's table too (it printed 0.003, and 0.000 for sparser ones).
    from tierserve.bench.fleet_bench import summary_table

    counts = {"num_refused": 0, "num_shed": 0, "num_rejected": 0, "num_unfinished": 0}
    tiers = {t: {**tiers[t], **counts} for t in tiers}
    hours = {"gpu_hours": 0.0012, "gpu_hours_common": 0.0012, "gpu_hours_arrivals": 0.0011}
    summary = {**summary, "tiers": tiers, "num_replicas_launched": 2, **hours}
    summary |= {"last_arrival_s": 55.0, "common_end_s": 60.0}
    line = summary_table([{**run, "summary": summary}]).splitlines()[1]
    assert "0.00278" in line and "0.0012" in line and "0.0011" in line


def test_rates_keep_three_significant_digits_with_their_trailing_zeros() -> None:
    """A goodput of exactly 1.0 printed as a bare `1` beside `0.964` in the row above."""
    from tierserve.fleet.report import rate_text

    cases = {1.0: "1.00", 0.964: "0.964", 0.9996: "1.00", 9.996: "10.0", 99.96: "100", 123.4: "123"}
    assert {x: rate_text(x) for x in cases} == cases
    assert rate_text(0.0) == "0.00" and rate_text(1e-7) == "0.000000100" and rate_text(None) == "-"


@pytest.mark.parametrize(
    "flag",
    [["--min-replicas", "5"], ["--max-replicas", "3"], ["--scale-interval-s", "60"], ["--idle-s", "1"]],
)
def test_an_autoscaler_flag_on_a_fixed_fleet_is_refused(
    flag: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--replicas 2 --min-replicas 5` ran a fixed fleet of 2 and wrote min_replicas 5 into
    results.json's meta, as if it had applied."""
    trace = _azure_trace(tmp_path / "trace.csv", 10, seed=2)
    argv = ["bench", "fleet", "--replicas", "2", "--trace", str(trace), *flag, "--out", str(tmp_path / "o")]
    assert main(argv) == 2
    assert f"{flag[0]} applies to scaling runs (--autoscale)" in capsys.readouterr().err


def test_one_row_cut_to_the_context_reads_as_one() -> None:
    from tierserve.fleet.report import _cut_lines

    meta = {"num_rows_cut_to_context": 1, "num_trace_rows": 12, "max_model_len": 4096}
    assert _cut_lines(meta)[0].startswith("**1 of the trace's 12 rows was cut to fit")
    assert "rows were cut" in _cut_lines({**meta, "num_rows_cut_to_context": 2})[0]


def test_the_terminal_table_gives_each_runs_own_gpu_hours_beside_those_to_the_last_end() -> None:
    """The same run read 77.4 GPU-hours beside overloaded fixed fleets that ran on to the
    drain timeout, and 46.7 alone: only the figure to the latest end was printed. Beside
    them, those to the last arrival, the same window for every run (a fleet that scaled in
    early read 21.0 GPU-h to the slowest run's end, 6.15 to its own)."""
    from tierserve.bench.fleet_bench import summary_table

    counts = {"num_refused": 0, "num_shed": 0, "num_rejected": 0, "num_unfinished": 0}
    tiers = {t: {"slo_attainment": 1.0, "goodput_rps": 1.0, **counts} for t in ("P0", "P1", "P2", "P3")}
    base = {"tiers": tiers, "num_replicas_launched": 2, "num_lost": 0, "common_end_s": 1622.0}
    base["last_arrival_s"] = 1200.0
    fixed_hours = {"gpu_hours": 7.21, "gpu_hours_common": 7.21, "gpu_hours_arrivals": 5.33}
    fixed = {"router": "round-robin", "scaling": "fixed", "summary": {**base, **fixed_hours}}
    scaled_hours = {"gpu_hours": 46.7, "gpu_hours_common": 77.4, "gpu_hours_arrivals": 31.2}
    scaled = {"router": "round-robin", "scaling": "tier", "summary": {**base, **scaled_hours}}
    lines = summary_table([fixed, scaled]).splitlines()
    assert "GPU-h  to last arrival  to last end" in lines[0]
    assert "46.7" in lines[2] and "31.2" in lines[2] and "77.4" in lines[2]
    assert lines[3].startswith("GPU-h: to each run's own end") and "1,622 s" in lines[3]
    assert "to last arrival: from the start to 1,200 s" in lines[3]


def test_a_scale_interval_past_the_runs_end_is_warned_of(tmp_path: Path) -> None:
    """The scaling rows read like any others while no decision had read any load."""
    trace = _azure_trace(tmp_path / "trace.csv", 20, seed=3)
    out = tmp_path / "out"
    argv = ["bench", "fleet", "--replicas", "1", "--trace", str(trace), "--autoscale", "tier"]
    assert main([*argv, "--scale-interval-s", "100000", "--out", str(out)]) == 0
    warned = json.loads((out / "results.json").read_text())["meta"]["input_warnings"]
    assert any(line.startswith("--scale-interval-s 100000: the scaling runs ended by") for line in warned)
    assert main([*argv, "--scale-interval-s", "1", "--out", str(tmp_path / "ok")]) == 0
    assert json.loads((tmp_path / "ok" / "results.json").read_text())["meta"]["input_warnings"] == []


def test_rows_cut_and_kills_are_said_under_the_table() -> None:
    from tierserve.bench.fleet_bench import _notes

    meta = {"num_rows_cut_to_context": 10, "num_trace_rows": 3993}
    faults = [[30.0, 0, "killed"], [5000.0, 1, "after the end"]]
    runs = [{"router": "tier-aware", "scaling": "fixed", "summary": {"faults": faults}}]
    assert _notes(meta, runs) == [
        "10 of the trace's 3993 rows were cut to the model's context",
        "faults, tier-aware / fixed: replica 0 at 30 s: killed; replica 1 at 5000 s: after the end",
    ]
    assert _notes({}, [{"router": "r", "scaling": "s", "summary": {"faults": []}}]) == []


@pytest.mark.parametrize(
    ("scale_by", "expected"),
    [
        (
            "copies",
            "replayed at --rate-scale 4 (the trace's hours, --scale-by copies): "
            "200 requests over 100 s, 2 requests/s, per run",
        ),
        (
            "time",
            "replayed at --rate-scale 4 (--scale-by time): 50 requests over 25 s, 2 requests/s, per run",
        ),
    ],
)
def test_the_replayed_line_says_what_each_run_sends_beside_the_trace_at_1x(
    scale_by: str, expected: str
) -> None:
    """The stderr line said "50 rows ... at 1x" where each run sent 200 requests."""
    rows = [
        TraceRecord(arrival_s=100.0 * i / 49, num_prompt_tokens=10, num_output_tokens=1) for i in range(50)
    ]
    args = argparse.Namespace(rate_scale=4.0, scale_by=scale_by)
    assert _replayed_line(args, 200 if scale_by == "copies" else 50, rows) == expected


def test_bench_fleet_runs_the_replicas_named_by_model_gpu_and_tp(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each replica was the default workload's 70B on 8 x A100, whatever the question."""
    trace = _azure_trace(tmp_path / "trace.csv", 20, seed=2)
    out = tmp_path / "out"
    argv = ["bench", "fleet", "--replicas", "2", "--trace", str(trace), "--out", str(out)]
    assert main([*argv, "--model", "llama-3.1-8b", "--gpu", "h100"]) == 0
    meta = json.loads((out / "results.json").read_text())["meta"]
    assert (meta["model"], meta["gpu"], meta["tp"]) == ("llama-3.1-8b", "h100-80gb", 1)
    assert "2 replicas of llama-3.1-8b on 1 x h100-80gb" in (out / "report.md").read_text()
    capsys.readouterr()
    # A deployment that cannot hold its K/V cache, or an unknown GPU: one line, status 2.
    for bad, said in (
        (["--model", "llama-3.1-70b", "--tp", "1"], "does not fit on 1 x a100-80gb"),
        (["--gpu", "v100"], "unknown GPU 'v100'"),
    ):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err


def test_bench_fleet_reads_the_gateway_settings_of_a_gateway_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The simulated gateway ran with the gateway's defaults whatever a deployment set: a
    gateway's own config file now sets its flow control and routing (its upstreams ignored).
    One replica full at one waiting request, and P1-P3 waiting at most 10 ms at the gateway:
    requests the defaults queue and serve are refused."""
    trace = _azure_trace(tmp_path / "trace.csv", 60, seed=3)
    config = tmp_path / "gateway.toml"
    config.write_text(
        "[gateway]\nmax_waiting = 1\nstale_after_s = 1.5\n"
        "[gateway.max_wait_s]\nP1 = 0.01\nP2 = 0.01\nP3 = 0.01\n"
        '[[upstreams]]\nkind = "vllm"\nurl = "http://127.0.0.1:9"\n'
    )
    argv = ["bench", "fleet", "--replicas", "1", "--trace", str(trace)]
    outcomes = []
    for extra in ([], ["--gateway-config", str(config)]):
        out = tmp_path / f"out{len(extra)}"
        assert main([*argv, "--out", str(out), *extra]) == 0
        results = json.loads((out / "results.json").read_text())
        outcomes.append(results["runs"][0]["summary"]["outcomes"])
    meta = results["meta"]
    assert meta["gateway_config"] == str(config)
    gateway = meta["gateway"]
    assert (gateway["max_waiting"], gateway["stale_after_s"], gateway["max_wait_s"]["P3"]) == (1, 1.5, 0.01)
    assert outcomes[0] == {"completed": 60} and outcomes[1].get("refused:queue_timeout", 0) > 0
    capsys.readouterr()
    # A misspelt key or section, or no [gateway] at all (a trial's [gatway] ran the defaults
    # without a word): one line naming the file.
    for text, said in (
        ("[gateway]\nmax_waitng = 1\n", "max_waitng"),
        ('[gateway]\npolicy = "fcfs"\n[serverr]\nport = 1\n', "serverr: unknown section"),
        ('[gatway]\npolicy = "fcfs"\n', "no [gateway] table"),
    ):
        config.write_text(text)
        assert main([*argv, "--out", str(tmp_path / "bad"), "--gateway-config", str(config)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(config) in err[0] and said in err[0], err
