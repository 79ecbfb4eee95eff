"""`tierserve bench engine` on a tiny workload: every figure is reported, HF agrees on tokens."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("torch")
pytest.importorskip("transformers")

from tierserve.bench import engine_bench

# The torch executor tests' tiny checkpoints (random weights and a tokenizer, written on the spot).
sys.path.insert(0, str(Path(__file__).parents[1] / "executors" / "pytorch"))

from torch_checkpoints import BOS_ID, EOS_ID, VOCAB_SIZE, write_checkpoint

TINY = ["--num-prompts", "3", "--prompt-tokens", "8", "24", "--output-tokens", "4", "8"]
TINY += ["--flood", "4", "--num-p0", "1", "--repeats", "1"]

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


def test_one_huge_row_that_shrinks_every_prompt_is_said(
    tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Scaled so the longest prompt fits, one row of 10,000,000 tokens made every other prompt
    about a token long, without a word (a new user's trial)."""
    trace = os.path.join(tmp_path, "huge.jsonl")
    with open(trace, "w") as f:
        for i in range(40):
            prompt = 10_000_000 if i % 10 == 0 else 500
            f.write(f'{{"timestamp": {i}, "input_length": {prompt}, "output_length": 8}}\n')
    argv = ["engine", "--lengths-from", trace, "--num-prompts", "40", "--skip-hf"]
    empty = os.path.join(tmp_path, "empty-model")
    os.mkdir(empty)
    args = _parser().parse_args([*argv, "--model", empty])
    assert args.func(args) == 2  # stops at the model (no config.json), after the note
    assert "note: --lengths-from: the longest drawn prompt is scaled to" in capsys.readouterr().err


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    engine_bench.register(parser.add_subparsers(dest="bench", required=True))
    return parser


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("engine-bench") / "tiny-llama"
    write_checkpoint(path)  # 512 tokens of context
    return path


def test_a_checkpoint_is_benchmarked_and_transformers_loads_the_same_weights(
    checkpoint_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parser().parse_args(["engine", "--model", str(checkpoint_dir), *TINY, "--json"])
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["model"] == str(checkpoint_dir)
    assert res["tierserve_tokens_per_s"] > 0 and 12 <= res["num_output_tokens"] <= 24
    assert res["hf_serial_tokens_per_s"] > 0 and res["p0_ttft_alone_s"] > 0
    # transformers read the checkpoint itself, not the demo model's weights: every greedy token agrees.
    assert res["greedy_agreement_with_hf"] == 1.0


def test_a_checkpoints_prompts_draw_its_vocabulary_but_not_bos_or_eos(checkpoint_dir: Path) -> None:
    executor = engine_bench.load_executor(str(checkpoint_dir), "cpu", threads=1)
    ids = engine_bench.prompt_token_ids(str(checkpoint_dir), executor)
    assert set(ids) == set(range(VOCAB_SIZE)) - {BOS_ID, EOS_ID}
    w = engine_bench.make_workload(20, seed=0, token_ids=ids)
    drawn = {t for p in w.prompts for t in p}
    assert max(drawn) >= 256 and not drawn & {BOS_ID, EOS_ID}  # past the demo model's byte ids


def test_the_text_report_names_the_checkpoint(
    checkpoint_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parser().parse_args(["engine", "--model", str(checkpoint_dir), *TINY, "--skip-hf"])
    assert args.func(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"model {checkpoint_dir} on cpu (1 thread): 3 prompts"), first


def test_a_bad_model_directory_is_one_line_and_exit_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, message in ((tmp_path / "none", "not a directory"), (empty, "config.json")):
        args = _parser().parse_args(["engine", "--model", str(path), "--skip-hf"])
        assert args.func(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("tierserve bench engine: --model:") and message in err, err
        assert err.count("\n") == 1, err


def test_lengths_past_the_checkpoints_context_are_refused_naming_the_flags(
    checkpoint_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _parser().parse_args(
        [
            "engine",
            "--model",
            str(checkpoint_dir),
            "--prompt-tokens",
            "8",
            "400",
            "--output-tokens",
            "4",
            "200",
        ]
    )
    assert args.func(args) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("tierserve bench engine: --prompt-tokens MAX + --output-tokens MAX")
    assert "400 + 200 = 600 tokens" in captured.err and "context of 512" in captured.err, captured.err
