"""A newcomer's first mistakes on the bench commands: each is refused in one line that names the
flag at fault, before a trace is read, an engine is started or a folder is made."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_cli_errors import run_cli


@pytest.mark.parametrize(
    ("argv", "words", "not_words"),
    [
        # argparse named the type's function: "invalid _range value: 'abc'".
        (
            ["bench", "serve", "--prompt-tokens", "abc"],
            "--prompt-tokens: expected LO-HI or N, got 'abc'",
            "_range",
        ),
        (
            ["bench", "reproduce", "--think-time", "-1"],
            "--think-time must be a finite number >= 0",
            "--burst-cv",
        ),
        (["bench", "reproduce", "--burst-cv", "0"], "--burst-cv must be a finite number > 0", "--think-time"),
        (["bench", "sim-speed", "--think-time", "-1"], "--think-time must be >= 0", "--load"),
        (["bench", "sim-speed", "--load", "-3"], "--load must be > 0", "--think-time"),
        # Unbounded before: a round or P0 count of zero started three vLLM engines for nothing.
        (["bench", "vllm", "--rounds", "0"], "--rounds: expected an integer >= 1", "--vllm-python"),
        (["bench", "vllm", "--num-p0", "0"], "--num-p0: expected an integer >= 1", "--vllm-python"),
        (["bench", "vllm", "--num-flood", "-1"], "--num-flood: expected an integer >= 0", "--vllm-python"),
        (["bench", "vllm", "--flood-s", "-1"], "--flood-s: expected a finite number >= 0", "--vllm-python"),
        (["bench", "vllm", "--timeout-s", "0"], "--timeout-s: expected a finite number > 0", "--vllm-python"),
    ],
)
def test_a_bad_value_is_said_as_its_own_flag(
    argv: list[str], words: str, not_words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path / "out" / ("x.json" if argv[1] in ("serve", "sim-speed") else ""))]
    code, err = run_cli([*argv, *out], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert words in err and not_words not in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_fleet_checks_the_tier_mix_before_it_reads_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was read as the first run began: after the trace was parsed, --out made and a progress
    bar drawn (and with no trace, the trace's error was said instead)."""
    argv = ["bench", "fleet", "--tier-mix", "1/1", "--trace", str(tmp_path / "missing.csv")]
    code, err = run_cli([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert err == "tierserve bench fleet: --tier-mix: tier mix '1/1': expected four shares like 5/60/30/5\n"
    assert not (tmp_path / "out").exists()


def test_sim_speed_refuses_trace_rows_for_closed_loop_clients(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--trace-rows was ignored on a synthetic workload; `bench reproduce` refuses it there."""
    small = ["--requests", "1", "--repeats", "1", "--load", "1", "--out", str(tmp_path / "s.json")]
    code, err = run_cli(["bench", "sim-speed", "--trace-rows", "5", *small], capsys)
    assert code == 2
    assert err == (
        "tierserve bench sim-speed: --trace-rows applies to a trace, and default runs closed-loop clients\n"
    )
    assert not (tmp_path / "s.json").exists()
