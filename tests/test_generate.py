"""`tierserve generate` and the `generate()` function, on the seeded demo model."""

from __future__ import annotations

import argparse
import json
import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
torch = pytest.importorskip("torch")

from tierserve import generate as gen  # noqa: E402
from tierserve.executors.pytorch.executor import build_torch_executor  # noqa: E402

BOS = 256


@pytest.fixture(scope="module")
def demo():
    torch.set_num_threads(1)
    return build_torch_executor("demo", num_device_blocks=64, num_host_blocks=8)


def cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    gen.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", *argv])
    code: int = args.func(args)
    return code


def test_prompt_ids_are_what_the_model_was_fed_bos_included(demo) -> None:
    result = gen.generate(*demo, "Hi!", max_tokens=12, ignore_eos=True)
    assert result.prompt_token_ids == [BOS, *b"Hi!"]
    assert len(result.token_ids) == 12 and result.finish_reason == "length"
    assert gen.generate(*demo, "Hi!", max_tokens=12, ignore_eos=True) == result  # greedy is deterministic


def test_chat_prompt_goes_through_the_template(demo) -> None:
    result = gen.generate(*demo, "Hi", max_tokens=2, chat=True)
    assert result.prompt_token_ids == [BOS, *b"user: Hi\nassistant:"]


def test_seed_makes_sampling_reproducible(demo) -> None:
    kw = {"max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "ignore_eos": True}
    a = gen.generate(*demo, "seeded", seed=3, **kw)
    assert gen.generate(*demo, "seeded", seed=3, **kw).token_ids == a.token_ids
    assert gen.generate(*demo, "seeded", seed=4, **kw).token_ids != a.token_ids


def test_stop_string_cuts_the_text_and_ends_the_request(demo) -> None:
    kw = {"max_tokens": 48, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    full = gen.generate(*demo, "go", **kw)
    # The first printable ASCII character that appears after the start of the text.
    index = next(
        i
        for i, ch in enumerate(full.text)
        if i >= 2 and ch.isascii() and ch.isprintable() and ch not in full.text[:i]
    )
    stop = full.text[index]
    cut = gen.generate(*demo, "go", stop=[stop], **kw)
    assert cut.text == full.text[:index]
    assert cut.finish_reason == "stop"
    assert len(cut.token_ids) < len(full.token_ids)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_cli_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["--prompt", "abc", "--max-tokens", "5", "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_token_ids"] == [BOS, *b"abc"]
    assert len(out["token_ids"]) == 5 and isinstance(out["text"], str)


def test_cli_prints_text_and_reports_bad_models(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert cli(["--prompt", "abc", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    assert cli(["--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_cli_penalties_stop_the_demo_repeating_itself(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--prompt", "Hello", "--max-tokens", "12", "--ignore-eos", "--json"]
    assert cli(argv) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert cli([*argv, "--frequency-penalty", "2"]) == 0
    penalised = json.loads(capsys.readouterr().out)["token_ids"]
    assert len(set(penalised)) > len(set(plain))  # the random demo model loves one token
    assert cli([*argv, "--presence-penalty", "3"]) == 2
    assert "--presence-penalty must be in [-2, 2], got 3" in capsys.readouterr().err
    assert cli([*argv, "--repetition-penalty", "1.5"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] != plain
    assert cli([*argv, "--repetition-penalty", "0"]) == 2
    assert "--repetition-penalty must be > 0, got 0" in capsys.readouterr().err


def test_kv_cache_gib_sizes_the_cache_and_a_request_past_it_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On a CPU the cache was 256 MiB whatever the model, and nothing could change it."""
    argv = ["--prompt", "Hello", "--max-tokens", "2000", "--ignore-eos", "--json"]
    assert cli([*argv, "--kv-cache-gib", "0.001"]) == 2
    said = capsys.readouterr().err
    assert "(the KV cache holds" in said and "; --kv-cache-gib gives the cache more memory" in said
    assert cli([*argv[:3], "8", "--kv-cache-gib", "0.001", "--json"]) == 0  # a request that fits
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) <= 8


def test_visible_escapes_control_characters_but_keeps_lines_and_text() -> None:
    assert gen.visible("a\bb\x1b[2J\x7f\r") == "a\\x08b\\x1b[2J\\x7f\\r"
    assert gen.visible("line\n\ttab é 中 \ufffd") == "line\n\ttab é 中 \ufffd"


def test_cli_text_shows_the_demos_control_characters_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--prompt", "hi", "--max-tokens", "48", "--temperature", "1", "--seed", "3", "--ignore-eos"]
    assert cli([*argv, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert any(ord(ch) < 32 and ch not in "\n\t" for ch in text)  # the demo does emit them
    assert cli(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == gen.visible(text) + "\n"
    # A note, not in the "tierserve generate: ..." form of an error.
    assert captured.err.startswith("note: the demo model has random weights")


def test_a_prompt_that_encodes_to_nothing_is_said_so_not_by_an_internal_id(demo) -> None:
    """A tokenizer that adds no BOS encodes "" to no tokens; the message named the engine's
    request id ("request 'generate-0': prompt must hold at least one token")."""
    executor, tokenizer = demo

    class NoBos:
        def encode(self, text: str) -> list[int]:
            return tokenizer.encode(text)[1:]  # the demo's, less its BOS

        def __getattr__(self, name: str) -> object:
            return getattr(tokenizer, name)

    with pytest.raises(ValueError, match=r"^the prompt is empty: it encodes to no tokens"):
        gen.generate(executor, NoBos(), "", max_tokens=2)  # type: ignore[arg-type]
