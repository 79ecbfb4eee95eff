"""`tierserve bench vllm`'s workload, open-loop driver and summary, on a fake contender
(the real contenders run in vLLM's virtualenv; see test_scheduler_on_vllm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierserve.bench.vllm_bench import (
    RUN_NAMES,
    BenchRequest,
    load_workload,
    make_workload,
    run_open_loop,
    save_workload,
)
from tierserve.bench.vllm_report import compare, summarize
from tierserve.cli import build_parser


class FakeContender:
    """Serves one request at a time, most urgent tier first, one token per step."""

    def __init__(self) -> None:
        self.queue: list[BenchRequest] = []
        self.done: dict[str, int] = {}

    def submit(self, req: BenchRequest, arrival: float) -> None:
        self.queue.append(req)

    def step(self) -> list[tuple[str, int, bool]]:
        self.queue.sort(key=lambda r: r.tier)
        req = self.queue[0]
        n = self.done.get(req.request_id, 0) + 1
        self.done[req.request_id] = n
        if n == req.max_tokens:
            self.queue.pop(0)
        return [(req.request_id, n, n == req.max_tokens)]

    def has_unfinished(self) -> bool:
        return bool(self.queue)


def test_workload_round_trips_and_mixes_tiers(tmp_path: Path) -> None:
    w = make_workload(seed=3, num_flood=20, num_p0=3, flood_s=0.05)
    save_workload(w, tmp_path / "w.json")
    assert load_workload(tmp_path / "w.json") == w
    assert {r.tier for r in w.flood} >= {0, 1}
    assert [r.tier for r in w.alone] == [0, 0, 0]
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(w.flood, w.flood[1:], strict=False))


def test_open_loop_records_every_request_and_the_summary_has_the_issue_keys() -> None:
    w = make_workload(seed=0, num_flood=6, num_p0=2, flood_s=0.02)
    result = run_open_loop(FakeContender(), w)
    recs = result["requests"]
    assert len(recs) == len(w.alone) + len(w.flood)
    assert all(r["ttft_s"] is not None and r["tokens"] > 0 for r in recs.values())
    summary = summarize(result)
    for key in ("p0_ttft_p95_alone_s", "p0_ttft_p95_flood_s", "throughput_tokens_per_s", "slo_attainment"):
        assert summary[key] is not None, key
    assert set(summary["slo_attainment"]) <= {"P0", "P1", "P2", "P3"}
    assert summary["throughput_tokens_per_s"] == pytest.approx(
        sum(r["tokens"] for r in recs.values() if r["phase"] == "flood") / result["flood_makespan_s"]
    )


def test_slo_attainment_counts_requests_within_their_tier_target() -> None:
    result = {
        "requests": {
            "a": {"tier": 0, "phase": "flood", "ttft_s": 0.1, "tokens": 4},
            "b": {"tier": 0, "phase": "flood", "ttft_s": 0.9, "tokens": 4},
            "c": {"tier": 1, "phase": "flood", "ttft_s": 4.0, "tokens": 4},
            "d": {"tier": 3, "phase": "flood", "ttft_s": 99.0, "tokens": 4},
        },
        "flood_makespan_s": 2.0,
    }
    s = summarize(result)
    assert s["slo_attainment"] == {"P0": 0.5, "P1": 1.0, "P3": 1.0}
    assert s["throughput_tokens_per_s"] == 8.0


def test_comparisons_are_ratios_of_the_runs() -> None:
    runs = {
        "vllm-fcfs": {"throughput_tokens_per_s": 100.0},
        "vllm-priority": {"p0_ttft_p95_flood_s": 2.0},
        "tierserve-plugin": {
            "p0_ttft_p95_flood_s": 0.5,
            "p0_ttft_p95_alone_s": 0.25,
            "throughput_tokens_per_s": 98.0,
        },
        "tierserve-engine": {"throughput_tokens_per_s": 50.0},
    }
    c = compare(runs)
    assert c["plugin_p0_flood_over_alone"] == 2.0
    assert c["plugin_p0_flood_over_vllm_priority"] == 0.25
    assert c["plugin_throughput_over_vllm_fcfs"] == 0.98
    assert c["engine_throughput_over_vllm_fcfs"] == 0.5
    assert set(runs) == set(RUN_NAMES)


def test_cli_has_bench_vllm() -> None:
    args = build_parser().parse_args(["bench", "vllm", "--json", "--num-flood", "4"])
    assert args.json and args.num_flood == 4


def test_rounds_bring_new_prompts_and_pool_into_one_summary_after_an_untimed_warm_up() -> None:
    w = make_workload(seed=1, num_flood=5, num_p0=2, flood_s=0.02, rounds=3)
    assert len(w.alone) == 6 and len(w.flood) == 21
    assert len({r.request_id for r in w.alone + w.flood}) == 27
    assert len({tuple(r.prompt) for r in w.alone}) == 6  # no round repeats another's prompts
    assert [r.round for r in w.flood] == sorted(r.round for r in w.flood)  # round by round
    contender = FakeContender()
    result = run_open_loop(contender, w)
    assert "warm-up" in contender.done and "warm-up" not in result["requests"]
    assert len(result["requests"]) == 27
    assert summarize(result)["num_requests"] == 27


def test_the_flood_records_each_requests_wait_for_the_step_in_flight_and_each_step() -> None:
    class Counting(FakeContender):
        num_steps = 0

        def step(self) -> list[tuple[str, int, bool]]:
            self.num_steps += 1
            return super().step()

    w = make_workload(seed=2, num_flood=8, num_p0=2, flood_s=0.02)
    contender = Counting()
    result = run_open_loop(contender, w)
    flood = [r for r in result["requests"].values() if r["phase"] == "flood"]
    assert all(0.0 <= r["wait_s"] <= r["ttft_s"] for r in flood)
    alone_steps = sum(r.max_tokens for r in w.alone) + 2  # and the warm-up's
    assert len(result["flood_step_s"]) == contender.num_steps - alone_steps
    summary = summarize(result)
    p0_waits = sorted(r["wait_s"] for r in flood if r["tier"] == 0)
    assert p0_waits[0] <= summary["p0_wait_for_step_p95_flood_s"] <= p0_waits[-1]
    assert summary["flood_step_p50_s"] is not None
    # One token a step (FakeContender): the flood's output tokens over its steps.
    assert summary["flood_steps"] == len(result["flood_step_s"])
    assert summary["flood_tokens_per_step"] == sum(r["tokens"] for r in flood) / summary["flood_steps"] == 1.0


def test_repeats_report_each_figures_median_and_keep_each_repeat() -> None:
    from tierserve.bench.vllm_bench import median_of
    from tierserve.bench.vllm_report import render

    def run(p95: float, p1: float, preempt: int | None) -> dict[str, Any]:
        return {"p0_ttft_p95_flood_s": p95, "slo_attainment": {"P1": p1}, "preemptions": preempt}

    repeats = [
        {"runs": {"tierserve-plugin": run(0.009, 1.0, 3)}, "comparisons": {"ratio": 2.0}},
        {"runs": {"tierserve-plugin": run(0.005, 0.5, None)}, "comparisons": {"ratio": 1.0}},
        {"runs": {"tierserve-plugin": run(0.007, 0.9, 5)}, "comparisons": {"ratio": None}},
    ]
    runs = median_of([r["runs"] for r in repeats])
    assert runs["tierserve-plugin"] == {
        "p0_ttft_p95_flood_s": 0.007, "slo_attainment": {"P1": 0.9}, "preemptions": 4,
    }  # fmt: skip
    assert median_of([r["comparisons"] for r in repeats]) == {"ratio": 1.5}
    assert median_of([{"a": None}, {"a": None}]) == {"a": None}
    assert median_of([{"n": 3}, {"n": 4}]) == {"n": 3.5}, "a count's median may fall between"
    assert isinstance(median_of([{"n": 3}, {"n": 5}])["n"], int)
    one = {"runs": {"x": 1}}
    assert median_of([one]) is one

    full = {
        "p0_ttft_p95_alone_s": 0.003, "p0_ttft_p95_flood_s": 0.007, "throughput_tokens_per_s": 10.0,
        "preemptions": 4, "slo_attainment": {"P0": 1.0},
    }  # fmt: skip
    text = render({"runs": {"tierserve-plugin": full}, "comparisons": {"ratio": 1.5}, "repeats": repeats})
    assert "ratio: 1.500  (each repeat: 2.000, 1.000, -)" in text
    assert "median of 3 repeats" in text


def test_cli_takes_repeats_and_refuses_zero() -> None:
    assert build_parser().parse_args(["bench", "vllm", "--repeats", "3"]).repeats == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "vllm", "--repeats", "0"])


def test_the_result_is_written_into_out_as_results_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--out is "the folder for the checkpoint and results.json": the JSON went to stdout only."""
    import json

    from tierserve.bench import vllm_bench

    monkeypatch.setattr(vllm_bench, "check_vllm_python", lambda python: None)
    monkeypatch.setattr(vllm_bench, "bench", lambda args: {"runs": {}, "comparisons": {"x": 1.0}})
    monkeypatch.setattr(vllm_bench, "render", lambda res: "table")
    args = build_parser().parse_args(["bench", "vllm", "--out", str(tmp_path / "o")])
    assert vllm_bench.run(args) == 0
    assert json.loads((tmp_path / "o" / "results.json").read_text())["comparisons"] == {"x": 1.0}
    assert capsys.readouterr().out.strip() == "table"
    (tmp_path / "afile").write_text("")
    args = build_parser().parse_args(["bench", "vllm", "--out", str(tmp_path / "afile")])
    with pytest.raises(ValueError, match=r"--out .*afile exists and is not a folder"):
        vllm_bench.run(args)
