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
            "--json",
        ]
    )
    assert args.func(args) == 0
    res = json.loads(capsys.readouterr().out)
    for key in KEYS:
        assert res[key] > 0, key
    assert res["greedy_agreement_with_hf"] == 1.0  # the same weights give the same tokens
    assert res["num_prompts"] == 3 and 12 <= res["num_output_tokens"] <= 24
