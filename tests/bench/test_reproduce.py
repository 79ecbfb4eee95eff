from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tierserve.bench.cell import BenchSetup, Cell, drive
from tierserve.bench.limits import EngineLimits
from tierserve.bench.matrix import Matrix, run_matrix
from tierserve.bench.report import write_all
from tierserve.bench.reproduce import FULL_PLAN, matrix_from_args, register, run, setup_json
from tierserve.scheduling.registry import BENCH_POLICIES

RUN_KEYS = {
    "policy",
    "workload",
    "arrival",
    "load",
    "seed",
    "tiers",
    "p0_slowdown_p95",
    "throughput_tokens_per_s",
    "throughput_vs_fcfs",
    "p3_completed",
    "p3_shed",
    "preemptions",
    "preemption_gpu_s",
    "kv_peak_used",
}
TIER_KEYS = {
    "requests",
    "slo_attainment",
    "ttft_p95_s",
    "ttft_p95_ci_s",
    "goodput_rps",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p95_s",
    "tpot_p99_s",
    "tpot_p95_ci_s",
}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["reproduce", *argv])


def tiny_matrix() -> Matrix:
    setup = BenchSetup(
        limits=EngineLimits("small", 2048, 8),
        num_measured=40,
        drain_timeout_s=120.0,
        capacity_requests=60,
    )
    groups = (("default", "poisson", 1.0), ("default", "closed", 8.0))
    return Matrix(setup, ("fcfs", "hybrid"), (0, 1), groups)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    matrix = tiny_matrix()
    out = tmp_path_factory.mktemp("bench")
    doc = {"setup": setup_json(matrix, quick=True), **run_matrix(matrix, workers=1, progress=False)}
    write_all(out, doc)
    loaded: dict[str, Any] = json.loads((out / "results.json").read_text())
    loaded["_out"] = str(out)
    return loaded


def test_results_json_keeps_every_required_field_for_every_run(results: dict[str, Any]) -> None:
    assert len(results["runs"]) == 2 * 2 * 2 and len(results["pooled"]) == 2 * 2
    for entry in results["runs"] + results["pooled"]:
        assert set(entry) >= RUN_KEYS
        assert entry["arrival"] in ("open", "closed")
        assert set(entry["tiers"]) == {"P0", "P1", "P2", "P3"}
        for tier in entry["tiers"].values():
            assert set(tier) >= TIER_KEYS
        assert entry["throughput_vs_fcfs"] is not None
    assert results["setup"]["engine_limits"] == {
        "name": "small",
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 8,
    }
    assert results["capacity"]["default"]["requests_per_s"] > 0
    fcfs = [r for r in results["runs"] if r["policy"] == "fcfs"]
    assert all(r["throughput_vs_fcfs"] == 1.0 for r in fcfs)
    assert {r["seed"] for r in results["runs"]} == {0, 1}
    assert all(r["seed"] == [0, 1] for r in results["pooled"])


def test_what_the_trace_loader_warned_of_is_in_the_report(results: dict[str, Any]) -> None:
    """It went to stderr only, past the progress bars; report.md, read later, said nothing."""
    from tierserve.bench.report import markdown

    assert "## Warnings on the traces" not in markdown(results)  # none warned: no section
    warned = {**results, "setup": {**results["setup"], "input_warnings": ["t.csv: skipped 2 rows"]}}
    report = markdown(warned)
    assert "## Warnings on the traces\n\n- t.csv: skipped 2 rows" in report
    assert "**input_warnings**" not in report  # not again among the setup's lines


def test_the_report_says_which_trace_rows_were_cut_and_which_capacity_was_not_measured(
    results: dict[str, Any],
) -> None:
    """Both were in results.json's setup values or on stderr only; `bench fleet`'s report says
    the first in bold."""
    from tierserve.bench.report import markdown

    setup = {
        **results["setup"],
        "trace_rows_read": {"t.csv": 296, "u.csv": 9},
        "trace_rows_cut_to_context": {"t.csv": 44, "u.csv": 0},
    }
    report = markdown(
        {
            **results,
            "setup": setup,
            "capacity": {**results["capacity"], "t.csv": {"requests_per_s": 1.5, "how": "fcfs saturated"}},
        }
    )
    assert "**44 of t.csv's 296 rows were cut to fit the model's context**" in report
    assert "of u.csv's" not in report  # none cut: no line
    assert "- **capacity of u.csv**: not measured (too few rows" in report
    assert "- **capacity of t.csv**: 1.5 requests/s" in report
    assert "capacity of default**: not measured" not in markdown(results)


def test_pooled_runs_hold_every_seeds_requests(results: dict[str, Any]) -> None:
    for pooled in results["pooled"]:
        same = [
            r
            for r in results["runs"]
            if (r["policy"], r["pattern"], r["load"]) == (pooled["policy"], pooled["pattern"], pooled["load"])
        ]
        for tier in ("P0", "P1", "P2", "P3"):
            assert pooled["tiers"][tier]["requests"] == sum(r["tiers"][tier]["requests"] for r in same)


def test_report_and_plots_are_written(results: dict[str, Any]) -> None:
    out = Path(results["_out"])
    report = (out / "report.md").read_text()
    assert "Quick run: small samples" in report
    assert "measured on real GPUs" in report and "reproduces" not in report
    assert "## Targets (hybrid)" in report and "## Sample-size warnings" in report
    assert (out / "p0_attainment.png").stat().st_size > 10_000 and (out / "goodput.png").exists()


def test_defaults_are_the_whole_matrix_on_vllm_limits_and_quick_is_smaller() -> None:
    full = matrix_from_args(parse())
    assert full.policies == BENCH_POLICIES
    assert (full.setup.limits.max_num_batched_tokens, full.setup.limits.max_num_seqs) == (2048, 256)
    loads = [x for w, p, x in full.groups if (w, p) == ("default", "poisson")]
    assert loads == [0.5, 0.8, 1.0, 1.2, 1.5]
    assert {w for w, _, _ in full.groups} == {"default", "memory-pressure"}
    assert {p for _, p, _ in full.groups} == {"poisson", "bursty", "closed"}
    assert len(full.groups) == sum(len(loads) for _, _, loads in FULL_PLAN)
    quick = matrix_from_args(parse("--quick"))
    assert len(quick.groups) < len(full.groups) and quick.setup.num_measured < full.setup.num_measured
    article = matrix_from_args(parse("--engine-limits", "article", "--max-num-seqs", "300"))
    assert (article.setup.limits.max_num_batched_tokens, article.setup.limits.max_num_seqs) == (8192, 300)


def test_explicit_cells_and_traces() -> None:
    m = matrix_from_args(
        parse("--workloads", "mooncake", "default", "--patterns", "bursty", "--loads", "1.5")
    )
    assert m.groups == (("mooncake", "trace", 1.0), ("default", "bursty", 1.5))
    closed = matrix_from_args(parse("--patterns", "closed", "--clients", "64"))
    assert closed.groups == (("default", "closed", 64.0),)
    twice = matrix_from_args(parse("--workloads", "mooncake", "--trace", "mooncake"))
    assert twice.groups == (("mooncake", "trace", 1.0),)  # named twice, run once
    # So is a load given twice (the pooled results held the cell twice; a seed twice is refused).
    again = matrix_from_args(parse("--workloads", "mooncake", "--trace-scale", "1", "2", "2"))
    assert again.groups == (("mooncake", "trace", 1.0), ("mooncake", "trace", 2.0))
    # The cell options name their arrivals (`--loads 2` alone also ran every closed loop).
    assert matrix_from_args(parse("--loads", "2")).groups == (("default", "poisson", 2.0),)
    assert matrix_from_args(parse("--clients", "8")).groups == (("default", "closed", 8.0),)
    assert {p for _, p, _ in matrix_from_args(parse("--burst-cv", "2", "--loads", "1")).groups} == {
        "poisson",
        "bursty",
    }
    # And a policy (it ran twice, and the report had one column for both).
    policies = matrix_from_args(parse("--policies", "hybrid", "fcfs", "hybrid")).policies
    assert policies == ("hybrid", "fcfs")


@pytest.mark.parametrize(
    "argv",
    [
        ["--policies", "nope"],
        ["--workloads", "default", "--patterns", "trace"],
        ["--think-time", "-1"],
        ["--seed", "1", "1"],
    ],
)
def test_bad_arguments_exit_2_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert run(parse(*argv)) == 2
    assert "tierserve bench reproduce:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [["--think-time", "nan"], ["--think-time", "inf"], ["--burst-cv", "nan"], ["--burst-cv", "inf"]]
)
def test_think_time_and_burst_cv_must_be_finite(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """nan passed the check and inf ran every cell, then failed to write results.json."""
    small = ["--patterns", "bursty", "closed", "--loads", "1", "--clients", "2", "--requests", "4"]
    args = parse(*argv, *small, "--policies", "fcfs", "--workers", "1", "--out", str(tmp_path / "out"))
    assert run(args) == 2
    assert f"{argv[0]} must be" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--patterns", "poisson", "--clients", "4"], "--clients"),
        (["--patterns", "closed", "--loads", "0.3"], "--loads"),
        (["--workloads", "default", "--trace-rows", "100"], "--trace-rows"),
        (["--trace-scale", "2"], "--trace-scale"),  # ran the whole default matrix
        (["--quick", "--trace-rows", "100"], "--trace-rows"),
        # A trace replays at its own timestamps: these were read past without a word.
        (["--workloads", "mooncake", "--patterns", "closed"], "--patterns"),
        (["--workloads", "mooncake", "--think-time", "1"], "--think-time"),
        (["--patterns", "poisson", "--burst-cv", "2"], "--burst-cv"),
    ],
)
def test_a_cell_option_no_cell_uses_is_refused(argv: list[str], flag: str) -> None:
    with pytest.raises(ValueError, match=f"{flag} applies to .* cells, and none runs"):
        matrix_from_args(parse(*argv))


def test_a_trace_slowed_past_ten_years_is_refused_before_any_cell_runs(
    shared_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = str(shared_data / "AzureLLMInferenceTrace_code.csv")
    out = tmp_path / "out"
    assert run(parse("--trace", trace, "--trace-scale", "1e-9", "--trace-rows", "50", "--out", str(out))) == 2
    assert "days at 1e-09 times its rate; at most 3,650.0 days" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("argv", [["--loads", "0"], ["--loads", "nan"], ["--requests", "0"]])
def test_bad_numbers_are_refused_as_they_are_parsed(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2


@pytest.mark.parametrize("rows", [400, 12])
def test_a_trace_cell_reports_its_offered_load_against_the_measured_capacity(
    rows: int, shared_data: Path, tmp_path: Path
) -> None:
    setup = BenchSetup(
        limits=EngineLimits("small", 2048, 8),
        num_measured=rows // 2,
        drain_timeout_s=60.0,
        capacity_requests=100,
        max_trace_rows=rows,
        data_dir=str(shared_data),
    )
    matrix = Matrix(setup, ("fcfs",), (0,), (("azure-code", "trace", 2.0),))
    doc = {"setup": setup_json(matrix, quick=True), **run_matrix(matrix, workers=1, progress=False)}
    (run_,) = doc["pooled"]
    if rows == 12:  # too short to saturate 16 clients: no capacity, no offered load, no failure
        assert doc["capacity"] == {} and run_["offered_load_x_capacity"] is None
        return
    assert doc["setup"]["trace_rows"] == rows  # what was replayed, in results.json and report.md
    assert doc["setup"]["trace_rows_cut_to_context"] == {"azure-code": 0}  # every row fits 128k
    # What the trace gave, read (a trace in the wrong time unit shows in its span).
    assert doc["setup"]["trace_rows_read"] == {"azure-code": rows}
    read = setup.trace_rows("azure-code")
    assert doc["setup"]["trace_span_s"] == {"azure-code": read[-1].arrival_s - read[0].arrival_s}
    capacity = doc["capacity"]["azure-code"]["requests_per_s"]
    trace = setup.trace_rows("azure-code")
    warmup = setup.num_measured // 10
    measured = trace[warmup : warmup + setup.num_measured]
    rate = (len(measured) - 1) / ((measured[-1].arrival_s - measured[0].arrival_s) / 2.0)
    assert run_["offered_load_x_capacity"] == pytest.approx(rate / capacity, rel=1e-3)
    assert run_["peak_offered_load_x_capacity"] >= run_["offered_load_x_capacity"]
    write_all(tmp_path, doc)
    report = (tmp_path / "report.md").read_text()
    assert f"({run_['offered_load_x_capacity']:.2f}x capacity; busiest minute" in report
    assert f"- **trace_rows**: {rows}" in report


def test_a_trace_shorter_than_the_warm_up_still_measures_most_of_its_rows(shared_data: Path) -> None:
    """The warm-up is a tenth of what the trace can give, not of `--requests`: 200 rows
    with the default 2,200 measured requests used to warm up on 220 and measure nothing."""
    setup = BenchSetup(num_measured=2200, max_trace_rows=200, data_dir=str(shared_data), drain_timeout_s=60.0)
    driven = drive(setup, Cell("azure-code", "trace", 1.0, "fcfs", 0))
    measured = [r for r in driven.run.records if r.measured]
    assert len(measured) == 180 and len(driven.run.records) == 200


def test_one_trace_file_by_two_paths_runs_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5}\n')
    monkeypatch.chdir(tmp_path)
    m = matrix_from_args(parse("--workloads", "t.jsonl", "--trace", str(trace)))
    assert [w for w, _, _ in m.groups] == ["t.jsonl"]


def test_a_bad_trace_fails_before_any_cell_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It used to fail after the cells of the workloads named before it (minutes)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    args = parse("--workloads", "default", str(bad), "--out", str(tmp_path / "out"), "--workers", "1")
    assert run(args) == 2
    assert "bad.jsonl:1: missing 'output_length'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_results_say_which_config_the_engine_ran_with(tmp_path: Path) -> None:
    """Only the TTFT targets were written: a run with other floors, weights or policy
    settings read the same as one with the defaults."""
    config = tmp_path / "tiers.toml"
    config.write_text(
        "[tiers.P0]\nfloor = 0.0\naging_s = 2.0\n[tiers.P1]\nreserve = 0.5\n"
        "[policy.hybrid]\np0_solo_share = 0.5\n"
    )
    m = matrix_from_args(
        parse("--config", str(config), "--policies", "fcfs", "hybrid", "--patterns", "closed")
    )
    setup = json.loads(json.dumps(setup_json(m, quick=False), allow_nan=False))
    assert setup["config"] == str(config)
    assert setup["tiers"]["P0"]["floor"] == 0.0 and setup["tiers"]["P0"]["aging_s"] == 2.0
    assert setup["tiers"]["P1"]["reserve"] == 0.5 and setup["tiers"]["P3"]["ttft_target_s"] is None  # inf
    assert setup["scheduler"]["max_num_batched_tokens"] == 2048  # the engine limits, not the config's
    assert setup["policy_options"] == {"hybrid": {**setup["policy_options"]["hybrid"], "p0_solo_share": 0.5}}
    assert setup["policy_options"]["hybrid"]["step_bound_x_p0"] is None  # its default, inf
    default = setup_json(matrix_from_args(parse("--policies", "fcfs")), quick=False)
    assert default["config"] == "built-in defaults" and default["policy_options"] == {}
    assert setup["config_sections_not_read"] == [] == default["config_sections_not_read"]


def test_a_servers_config_given_to_the_bench_says_what_it_does_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """deploy/example-config.toml's [server], [limits] and [tenants] were dropped in silence."""
    config = tmp_path / "server.toml"
    config.write_text(
        "[tiers.P0]\nfloor = 0.1\n[limits]\nrequests_per_s = 5\n[tenants.a]\napi_keys = ['k']\n"
        "[scheduler]\nmax_num_seqs = 8\nswap_factor = 0.5\n"
    )
    out = tmp_path / "out"
    argv = ["--config", str(config), "--policies", "fcfs", "--patterns", "closed", "--clients", "4"]
    assert run(parse(*argv, "--requests", "20", "--out", str(out))) == 0
    err = capsys.readouterr().err
    assert f"note: {config}: [tenants], [limits] not read" in err
    # The engine limits replaced the file's max_num_seqs without a word.
    assert f"note: {config}: [scheduler] max_num_seqs replaced by the engine limits" in err
    results = json.loads((out / "results.json").read_text())
    setup = results["setup"]
    assert setup["config_sections_not_read"] == ["tenants", "limits", "scheduler.max_num_seqs"]
    assert setup["scheduler"]["max_num_seqs"] == 256 and setup["scheduler"]["swap_factor"] == 0.5


def test_one_trace_row_cut_reads_in_the_singular() -> None:
    from tierserve.bench.report import _trace_notes

    setup = {"trace_rows_read": {"t.csv": 296}, "trace_rows_cut_to_context": {"t.csv": 1}}
    (line,) = _trace_notes({"setup": setup})
    assert line.startswith("**1 of t.csv's 296 rows was cut")
    assert line.endswith("that request is not the trace's.")


def test_rows_cut_to_the_context_are_said_on_the_console_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench fleet` printed it; `bench reproduce` wrote it to report.md and results.json only
    (a new user's trial, on a trace with 10,000,000-token rows)."""
    trace = tmp_path / "t.jsonl"
    rows = [(i * 2.0, 10_000_000 if i == 3 else 100, 20) for i in range(12)]
    trace.write_text(
        "".join(f'{{"timestamp": {t}, "input_length": {p}, "output_length": {o}}}\n' for t, p, o in rows)
    )
    argv = ["--workloads", str(trace), "--policies", "fcfs", "--workers", "1"]
    assert run(parse(*argv, "--requests", "10", "--out", str(tmp_path / "out"))) == 0
    assert f"note: 1 of {trace}'s 12 rows was cut to the model's context" in capsys.readouterr().err
