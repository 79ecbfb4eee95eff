"""`tierserve bench engine` on a tiny workload: every figure is reported, HF agrees on tokens."""

from __future__ import annotations

import argparse
import json
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("torch")
pytest.importorskip("transformers")

from tierserve.bench import engine_bench

KEYS = (
    "tierserve_tokens_per_s",
    "hf_serial_tokens_per_s",
    "hf_batched_tokens_per_s",
    "p0_ttft_alone_s",
    "p0_ttft_under_flood_s",
)


def test_workload_is_seeded_and_within_its_ranges() -> None:
    a = engine_bench.make_workload(20, seed=4, prompt_range=(16, 256), output_range=(16, 128))
    assert a == engine_bench.make_workload(20, seed=4, prompt_range=(16, 256), output_range=(16, 128))
    assert all(16 <= len(p) <= 256 for p in a.prompts)
    assert all(16 <= n <= 128 for n in a.max_tokens)
    assert a.num_output_tokens == sum(a.max_tokens)
    assert len({len(p) for p in a.prompts}) > 5


def test_small_bench_reports_every_figure_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    engine_bench.register(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(
        [
            "engine",
            "--num-prompts",
            "3",
            "--prompt-tokens",
            "8",
            "24",
            "--output-tokens",
            "4",
            "8",
            "--flood",
            "6",
            "--num-p0",
            "1",
            "--repeats",
            "3",
            "--json",
        ]
    )
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    for key in KEYS:
        assert res[key] > 0, key
    assert res["greedy_agreement_with_hf"] == 1.0  # the same weights give the same tokens
    assert res["num_prompts"] == 3 and 12 <= res["num_output_tokens"] <= 24
    assert res["host"]["num_cpus"] >= 1 and isinstance(res["host"]["busy"], bool)  # how busy the host was
    # The speed-up is the median of the three engine / padded-batch pairs' ratios.
    ratios = res["speedup_vs_hf_batched_runs"]
    assert len(ratios) == 3 and res["speedup_vs_hf_batched"] == sorted(ratios)[1]


def _azure_trace(path: os.PathLike[str], rows: list[tuple[int, int]]) -> None:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    lines += [f"2023-11-16 18:15:{i:02d}.0000000,{c},{g}" for i, (c, g) in enumerate(rows)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def test_trace_lengths_keep_the_traces_spread_at_the_benchs_scale(tmp_path: os.PathLike[str]) -> None:
    trace = os.path.join(tmp_path, "t.csv")
    _azure_trace(trace, [(100, 10), (1000, 40), (4000, 80), (8000, 20)])
    lengths = engine_bench.trace_lengths(trace, 40, seed=1, prompt_max=256, output_max=128)
    assert lengths == engine_bench.trace_lengths(trace, 40, seed=1, prompt_max=256, output_max=128)
    prompts, outputs = zip(*lengths, strict=True)
    assert max(prompts) == 256 and max(outputs) == 128  # every row is drawn in 40 tries
    assert set(prompts) == {3, 32, 128, 256} and set(outputs) == {16, 64, 128, 32}
    w = engine_bench.make_workload(40, seed=1, lengths=lengths)
    assert [len(p) for p in w.prompts] == list(prompts) and w.max_tokens == list(outputs)


def test_a_missing_or_malformed_trace_is_a_clear_error(
    tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    engine_bench.register(parser.add_subparsers(dest="bench", required=True))
    bad = os.path.join(tmp_path, "bad.csv")
    with open(bad, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:00.0,lots,3\n")
    for path, message in ((os.path.join(tmp_path, "none.csv"), "no such trace file"), (bad, "bad.csv:2")):
        args = parser.parse_args(["engine", "--lengths-from", path, "--skip-hf"])
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("tierserve bench engine: --lengths-from:") and message in err, err
