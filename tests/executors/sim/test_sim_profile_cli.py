from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    assert len(notes) == 3 and "exceeds the model's context (131,072)" in notes[0]
    assert "a prefill of 10,000,000 tokens" in notes[1] and "that fit" in notes[1]
    assert "a decode step of 100,000" in notes[2] and "that fit" in notes[2]
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


def test_a_prefill_within_the_context_but_not_the_kv_cache_has_a_note(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """70B on 2 x H100 holds 22,876 tokens of K/V: a 65,536-token prefill printed no note."""
    argv = ["profile", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "2"]
    assert run([*argv, "--prefill-tokens", "65536", "--json"]) == 0
    (note,) = json.loads(capsys.readouterr().out)["beyond_limits"]
    assert note.startswith("a prefill of 65,536 tokens") and "over the 22,876 that fit" in note


def _write_config(folder: Path, **overrides: object) -> Path:
    """A Qwen2-7B-shaped config.json (no weights: the simulator reads none)."""
    folder.mkdir()
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "torch_dtype": "bfloat16",
        **overrides,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_local_model_directory_is_profiled_from_its_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only the three built-in names were accepted: a planner could not profile their own model."""
    folder = _write_config(tmp_path / "qwen2-7b")
    assert run(["profile", "--model", str(folder), "--gpu", "h100-80gb", "--tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # K and V, 28 layers, 4 KV heads of 3584 / 28 = 128, 2 bytes: per token, on the model.
    assert out["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2
    assert out["kv_capacity_tokens"] > 0 and out["decode_step_s"] > 0 and out["model"] == str(folder)
    config_file = folder / "config.json"
    assert run(["profile", "--model", str(config_file), "--gpu", "h100-80gb", "--tp", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == out["kv_bytes_per_token"]


def test_a_model_directory_the_cost_model_cannot_price_is_refused_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    awq = _write_config(tmp_path / "awq", quantization_config={"quant_method": "awq", "bits": 4})
    assert run(["profile", "--model", str(awq), "--gpu", "h100-80gb"]) == 2
    assert "quantized weights (awq) are not modelled" in capsys.readouterr().err
    moe = _write_config(tmp_path / "moe", architectures=["MixtralForCausalLM"])
    assert run(["profile", "--model", str(moe), "--gpu", "h100-80gb"]) == 2
    assert "unsupported architecture 'MixtralForCausalLM'" in capsys.readouterr().err
    assert run(["profile", "--model", str(tmp_path / "absent"), "--gpu", "h100-80gb"]) == 2
    assert "or a local model directory" in capsys.readouterr().err


def test_kv_heads_copied_past_their_number_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    """At --tp 16 a model of 8 KV heads printed twice its bytes per token as if they were its own."""
    assert run(["profile", "--model", "llama-3.1-70b", "--gpu", "h200", "--tp", "16"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "K/V bytes per token" in x)
    assert "655,360 on the 16 GPUs" in line and "its 8 KV heads are copied" in line
    assert run(["profile", "--model", "llama-3.1-70b", "--gpu", "h200", "--tp", "8"]) == 0
    assert "copied" not in capsys.readouterr().out


def test_shapes_past_any_deployment_are_refused_not_overflowed(capsys: pytest.CaptureFixture[str]) -> None:
    """A prefill of 10**20 tokens ended in OverflowError and exit 1; a huge --batch took minutes."""
    for flag in ("--prefill-tokens", "--batch", "--context"):
        assert run(["profile", "--model", "demo", "--gpu", "h200", flag, str(10**20)]) == 2
        assert flag in capsys.readouterr().err
    argv = ["profile", "--model", "llama-3.1-8b", "--gpu", "h200", "--batch", "1000000000", "--context", "10"]
    assert run([*argv, "--json"]) == 0  # a big batch is summed, not listed
    assert json.loads(capsys.readouterr().out)["decode_step_s"] > 0


def test_a_memory_share_is_printed_as_given(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["profile", "--model", "llama-3.1-8b", "--gpu", "h200", "--mem-util", "0.925"]) == 0
    assert "K/V capacity at 92.5% of memory" in capsys.readouterr().out


def test_a_sliding_window_caps_the_context_as_the_torch_executor_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mistral-7B-v0.1's window of 4,096 was dropped: a 16k context was profiled without a note."""
    folder = _write_config(tmp_path / "mistral", architectures=["MistralForCausalLM"], sliding_window=4096)
    assert run(["profile", "--model", str(folder), "--gpu", "h100-80gb", "--context", "16000", "--json"]) == 0
    (note,) = json.loads(capsys.readouterr().out)["beyond_limits"]
    assert "exceeds the model's context (4,096)" in note


def test_a_cache_smaller_than_one_full_context_request_is_a_caveat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It "fits", and vLLM would refuse to start at the model's own context length."""
    argv = ["profile", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "2", "--mem-util", "0.95"]
    assert run([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (caveat,) = out["caveats"]
    assert out["fits"] and out["kv_capacity_tokens"] < 131_072
    assert f"holds {out['kv_capacity_tokens']:,} tokens, fewer than one request" in caveat
