from __future__ import annotations

import argparse
import json

import pytest

from tierserve.executors.sim import profile_cli
from tierserve.executors.sim.cost_model import CostModel
from tierserve.executors.sim.gpus import A100_80GB
from tierserve.model_config import LLAMA_3_1_70B


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tierserve")
    profile_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


def test_json_output_has_the_documented_keys_and_model_values(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["profile", "--model", "llama-3.1-70b", "--gpu", "a100-80gb", "--tp", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"prefill_s", "decode_step_s", "kv_bytes_per_token", "kv_capacity_tokens"} <= out.keys()
    cm = CostModel(A100_80GB, LLAMA_3_1_70B, 8)
    assert out["prefill_s"] == pytest.approx(cm.prefill_s(2048))  # defaults: 2048-token prefill,
    assert out["decode_step_s"] == pytest.approx(cm.decode_step_s(1, 2048))  # batch 1 at context 2048
    assert out["kv_bytes_per_token"] == 327_680
    assert out["kv_capacity_tokens"] == cm.kv_capacity_tokens(0.9)


def test_options_change_the_shapes_predicted(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["profile", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--json"]
    run([*argv, "--batch", "1", "--context", "128", "--prefill-tokens", "128"])
    small = json.loads(capsys.readouterr().out)
    run([*argv, "--batch", "64", "--context", "8192", "--prefill-tokens", "8192"])
    big = json.loads(capsys.readouterr().out)
    assert big["decode_step_s"] > small["decode_step_s"]
    assert big["prefill_s"] > small["prefill_s"]


def test_text_output_names_each_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["profile", "--model", "llama-3.1-8b", "--gpu", "h200"]) == 0
    out = capsys.readouterr().out
    for words in (
        "prefill of 2048 tokens",
        "decode step, batch 1, context 2048",
        "K/V bytes per token",
        "capacity",
    ):
        assert words in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "gpt-9", "--gpu", "h200"], "known models"),
        (["--model", "demo", "--gpu", "tpu-v5"], "known GPUs"),
        (["--model", "llama-3.1-70b", "--gpu", "h200", "--tp", "3"], "tp=3"),
        (["--model", "demo", "--gpu", "h200", "--batch", "0"], "--batch"),
    ],
)
def test_bad_arguments_exit_2_with_a_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(["profile", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_model_that_does_not_fit_says_so_and_names_a_tp_that_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run(["profile", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # no "capacity 0 tokens" figures (--json: the verdict, below)
    [line] = captured.err.splitlines()
    assert "does not fit on 1 x" in line and "try --tp 2" in line
    assert run(["profile", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_capacity_tokens"] > 0


def test_a_shape_no_engine_runs_is_predicted_with_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    """A prefill past the model's context and a decode batch whose K/V does not fit were
    printed as ordinary steps."""
    argv = ["profile", "--model", "llama-3.1-8b", "--gpu", "h200", "--prefill-tokens", "10000000"]
    assert run([*argv, "--batch", "100000"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert len(notes) == 2 and "exceeds the model's context (131,072)" in notes[0]
    assert "over the" in notes[1] and "that fit" in notes[1]
    assert run(["profile", "--model", "llama-3.1-8b", "--gpu", "h200", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["beyond_limits"] == []  # the defaults are a real step


def test_a_tp_beyond_one_node_says_its_times_are_optimistic(capsys: pytest.CaptureFixture[str]) -> None:
    """--tp 16 printed times below --tp 8's with no word that the cost model joins all 16 GPUs
    by NVLink, as if they were one node."""
    assert run(["profile", "--model", "llama-3.1-8b", "--gpu", "h200", "--tp", "16"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert len(notes) == 1 and "--tp 16 spans 2 nodes of 8 GPUs" in notes[0] and "optimistic" in notes[0]
    assert run(["profile", "--model", "llama-3.1-8b", "--gpu", "h200", "--tp", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["caveats"] == []


def test_json_says_when_the_model_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["profile", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--json"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["fits"] is False and "try --tp 2" in out["reason"] and "does not fit" in captured.err
