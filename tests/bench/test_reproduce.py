from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tierserve.bench.reproduce import Load, Sweep, register, run_sweep, sweep_from_args, write_outputs
from tierserve.executors.null import NullExecutor

REQUIRED_RUN_KEYS = {
    "policy",
    "concurrency",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "slo_attainment",
    "completed",
    "rejected",
    "max_wait_s",
    "throughput_tokens_per_s",
    "utilization",
    "preemptions",
    "prefix_cache_hit_rate",
    "p0_slowdown",
}
PER_TIER_KEYS = (
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "slo_attainment",
    "completed",
    "rejected",
    "max_wait_s",
)
REQUIRED_SETUP_KEYS = {
    "model",
    "gpu",
    "tp",
    "workload",
    "seed",
    "trace",
    "policies",
    "concurrencies",
    "tier_mix",
    "tier_assignment",
    "git_commit",
}


def null_executor(sweep: Sweep) -> NullExecutor:
    executor = NullExecutor(num_device_blocks=8192, num_host_blocks=8192, step_s=0.02, per_token_s=2e-5)
    executor.record = False
    return executor


def tiny_sweep(seed: int = 0, policies: tuple[str, ...] = ("fcfs", "hybrid")) -> Sweep:
    return Sweep(
        seed=seed,
        policies=policies,
        loads=(Load("4", concurrency=4), Load("8", concurrency=8)),
        num_measured=40,
        drain_timeout_s=5.0,
    )


def reproduce(
    tmp_path: Path, seed: int = 0, policies: tuple[str, ...] = ("fcfs", "hybrid")
) -> dict[str, Any]:
    results = run_sweep(tiny_sweep(seed, policies), null_executor, workers=1, progress=False)
    write_outputs(tmp_path, results)
    loaded: dict[str, Any] = json.loads((tmp_path / "results.json").read_text())
    return loaded


def test_quick_reproduction_accounts_for_every_request_and_writes_every_key(tmp_path: Path) -> None:
    results = reproduce(tmp_path)
    assert set(results["setup"]) >= REQUIRED_SETUP_KEYS
    assert [(r["policy"], r["concurrency"]) for r in results["runs"]] == [
        ("fcfs", 4),
        ("fcfs", 8),
        ("hybrid", 4),
        ("hybrid", 8),
    ]
    for run in results["runs"]:
        assert set(run) >= REQUIRED_RUN_KEYS
        for key in PER_TIER_KEYS:
            assert set(run[key]) == {"P0", "P1", "P2", "P3"}
        assert set(run["preemptions"]) == {"swap", "recompute"}
        assert run["accounted"] and sum(run["measured"].values()) == 40
        assert (
            sum(run["completed"].values()) + sum(run["rejected"].values()) + sum(run["aborted"].values())
            == 40
        )
        assert run["p0_slowdown"] is not None and run["p0_slowdown"] >= 0.99  # never faster than alone
    report = (tmp_path / "report.md").read_text()
    assert "P0 P95 TTFT" in report and "## Targets (hybrid)" in report and "MET" in report
    assert (tmp_path / "ttft_p95.png").read_bytes()[:4] == b"\x89PNG"


def test_same_seed_gives_the_same_results_json(tmp_path: Path) -> None:
    first = reproduce(tmp_path / "a", seed=3, policies=("hybrid",))
    assert reproduce(tmp_path / "b", seed=3, policies=("hybrid",)) == first
    assert (tmp_path / "a" / "results.json").read_bytes() == (tmp_path / "b" / "results.json").read_bytes()
    assert reproduce(tmp_path / "c", seed=4, policies=("hybrid",))["runs"] != first["runs"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["reproduce", *argv])


def test_defaults_are_the_article_sweep_and_quick_is_smaller() -> None:
    full = sweep_from_args(parse())
    assert full.policies == ("fcfs", "vllm-priority", "sglang-priority", "article", "hybrid")
    assert [ld.concurrency for ld in full.loads] == [32, 64, 128, 256, 512]
    assert full.num_measured * 0.05 >= 100  # enough P0 for a P95
    quick = sweep_from_args(parse("--quick"))
    assert len(quick.loads) < len(full.loads) and quick.num_measured < full.num_measured


def test_open_loop_trace_loads_and_measured_count_fit_the_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {i * 100}, "input_length": 600, "output_length": 4, "hash_ids": [0, {i + 1}]}}\n'
            for i in range(50)
        )
    )
    sweep = sweep_from_args(parse("--trace", str(trace), "--open-loop", "--rate-scale", "1", "2"))
    assert [(ld.label, ld.rate_scale, ld.concurrency) for ld in sweep.loads] == [
        ("x1", 1.0, None),
        ("x2", 2.0, None),
    ]
    assert sweep.num_measured + sweep.warmup(sweep.loads[0]) <= 50


def test_open_loop_trace_replay_runs(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:17:{i // 10:02d}.{i % 10}000000,{100 + i},{1 + i % 7}\n" for i in range(80))
    )
    sweep = sweep_from_args(
        parse("--trace", str(trace), "--open-loop", "--rate-scale", "2", "--policies", "fcfs")
    )
    results = run_sweep(sweep, null_executor, workers=1, progress=False)
    (run,) = results["runs"]
    assert run["rate_scale"] == 2.0 and run["concurrency"] is None
    assert sum(run["completed"].values()) == sweep.num_measured
    assert "traces carry no tier" in results["setup"]["tier_assignment"]
    from tierserve.bench import report

    p1_slo = next(t for t in report.targets([{**run, "policy": "hybrid"}]) if "P1 SLO" in t[0])
    assert p1_slo[1] is None, "the P1 SLO target is for closed-loop runs"


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--policies", "lifo"), "unknown policies"),
        (("--tier-mix", "1/2"), "tier mix"),
        (("--trace", "/nonexistent/t.csv"), "no such trace"),
        (("--concurrency", "0"), "positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(*argv)
    assert args.func(args) == 2
    assert message in capsys.readouterr().err


def test_command_runs_on_the_simulator(tmp_path: Path) -> None:
    pytest.importorskip("tierserve.executors.sim")
    args = parse(
        "--out",
        str(tmp_path),
        "--policies",
        "fcfs",
        "hybrid",
        "--concurrency",
        "4",
        "--requests",
        "12",
        "--warmup",
        "2",
        "--drain-timeout",
        "20",
        "--workers",
        "1",
    )
    assert args.func(args) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["setup"]["model"] == "llama-3.1-70b" and len(results["runs"]) == 2
    assert all(0 < run["utilization"] <= 1 for run in results["runs"])


def test_several_seeds_report_medians_sums_and_maxima(tmp_path: Path) -> None:
    from tierserve.bench import report
    from tierserve.bench.reproduce import run_seeds

    results = run_seeds(tiny_sweep(policies=("hybrid",)), [0, 1, 2], null_executor, workers=1)
    runs = results["runs"]
    assert results["setup"]["seed"] == [0, 1, 2]
    assert sorted(r["seed"] for r in runs) == [0, 0, 1, 1, 2, 2]
    summary = report.across_seeds(runs)
    assert len(summary) == 2
    for merged in summary:
        mine = [r for r in runs if r["load"] == merged["load"]]
        assert merged["seed"] == [0, 1, 2]
        assert merged["ttft_p95_s"]["P1"] == pytest.approx(sorted(r["ttft_p95_s"]["P1"] for r in mine)[1])
        assert merged["completed"]["P1"] == sum(r["completed"]["P1"] for r in mine)
        assert merged["submitted"] == sum(r["submitted"] for r in mine)
        assert merged["max_wait_s"]["P1"] == max(r["max_wait_s"]["P1"] for r in mine)
        assert merged["concurrency"] == mine[0]["concurrency"]
        assert merged["accounted"] is True
    write_outputs(tmp_path, results)
    assert "median over the seeds" in (tmp_path / "report.md").read_text()
    assert report.across_seeds(runs[:2]) == runs[:2]  # one seed per cell: unchanged


def test_seeds_must_be_distinct() -> None:
    from tierserve.bench.reproduce import run_seeds

    with pytest.raises(ValueError, match="distinct"):
        run_seeds(tiny_sweep(), [1, 1], null_executor)
