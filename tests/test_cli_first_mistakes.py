"""A newcomer's first mistakes on the commands: each is refused in one line that names the flag at
fault, before a trace is read, a model is built, an engine is started or a folder is made."""

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
            "--think-time must be 0 to 86400 s",
            "--burst-cv",
        ),
        (["bench", "reproduce", "--burst-cv", "0"], "--burst-cv must be > 0 and at most 16", "--think-time"),
        (["bench", "sim-speed", "--think-time", "-1"], "--think-time must be 0 to 86400 s", "--load"),
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


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--top-p", "0"], "tierserve generate: --top-p must be in (0, 1], got 0\n"),
        (["--presence-penalty", "5"], "tierserve generate: --presence-penalty must be in [-2, 2], got 5\n"),
        (["--top-k", "-1"], "tierserve generate: --top-k must be >= 0, got -1\n"),
        (
            ["--max-tokens", "100000"],
            "tierserve generate: --max-tokens must be below the model's context of 4096 tokens, "
            "got 100000: the prompt takes at least one token\n",
        ),
    ],
)
def test_generate_refuses_a_sampling_value_by_its_flag_before_building_the_model(
    flags: list[str], words: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were SamplingParams' checks, met after the model was built (seconds), said as the
    field (`top_p must be ...`) after the demo notice: two lines."""

    def build(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a model was built")

    monkeypatch.setattr("tierserve.executors.pytorch.executor.build_torch_executor", build)
    code, err = run_cli(["generate", "--prompt", "x", *flags], capsys)
    assert code == 2
    assert err == words


def test_generate_says_a_refused_request_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Within the context alone, but not with the prompt: refused once the prompt is read, and
    the demo notice, printed before it, made it the second line."""
    code, err = run_cli(["generate", "--prompt", "xy", "--max-tokens", "4095"], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "exceeds the model's context of 4096 tokens" in err and "random weights" not in err


def test_serve_sim_too_small_names_the_gpu_as_the_flag_takes_it_and_the_tp_that_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It said `--gpu A100-80GB --tp 1: ... leaves no memory for the K/V cache`, naming no --tp."""
    argv = ["serve", "--backend", "sim", "--model", "llama-3.1-70b", "--tp", "1", "--port", "0"]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("tierserve serve: llama-3.1-70b does not fit on 1 x a100-80gb: ")
    assert err.endswith("; try --tp 2\n") and "A100" not in err


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--tp", "0"], "tierserve profile: --tp must be >= 1, got 0\n"),
        (["--mem-util", "2"], "tierserve profile: --mem-util must be in (0, 1], got 2\n"),
        (["--mem-util", "0"], "tierserve profile: --mem-util must be in (0, 1], got 0\n"),
    ],
)
def test_profile_names_the_flag_not_the_field(
    flags: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["profile", "--model", "llama-3.1-8b", "--gpu", "h200", *flags], capsys)
    assert code == 2
    assert err == words


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--model", "gpt-9"], "--model: unknown model 'gpt-9'"),
        (["--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--tp", "3"], "tp=3 does not divide"),
        (["--tp", "1"], "does not fit on 1 x a100-80gb"),
        (["--config", "/nonexistent/tierserve-test/c.toml"], "no such config file"),
        (["--api-key-env", "TIERSERVE_TEST_UNSET_KEY"], "--api-key-env TIERSERVE_TEST_UNSET_KEY"),
    ],
)
def test_bench_serve_checks_the_deployment_before_it_makes_the_out_folder(
    flags: list[str],
    words: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The server's engine process refused them, after --out's folder was made: left empty."""
    monkeypatch.delenv("TIERSERVE_TEST_UNSET_KEY", raising=False)
    argv = ["bench", "serve", "--requests", "2", *flags, "--out", str(tmp_path / "out" / "s.json")]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert words in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--model", "gpt-9"], "unknown model 'gpt-9'"),
        (["--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--repeats", "0"], "--repeats: expected an integer >= 1, got 0"),
    ],
)
def test_sim_check_checks_its_settings_before_it_makes_the_out_folder(
    flags: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(["bench", "sim-check", *flags, "--out", str(tmp_path / "out" / "x.json")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert words in err
    assert not (tmp_path / "out").exists()


def test_sim_check_checks_free_memory_before_it_makes_the_out_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model too large for the device was found only once the executor was built, after
    `--out`'s folder was made (left behind, empty)."""
    from tierserve.bench import sim_check

    monkeypatch.setattr(sim_check, "_available_bytes", lambda _device: 20 << 30)
    argv = ["bench", "sim-check", "--model", "llama-3.1-8b", "--out", str(tmp_path / "out" / "x.json")]
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the weights alone do not fit" in err
    assert not (tmp_path / "out").exists()


def test_an_interrupted_reproduce_says_so_after_its_progress_bar(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bar closed when the interrupted frames were let go, after the line: it was drawn again
    below `interrupted`, which was then not the last line on the screen."""
    from tierserve.bench import matrix

    def interrupted(_job: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(matrix, "measure_capacities", lambda _matrix, _workers: {})
    monkeypatch.setattr(matrix, "_run_job", interrupted)
    code, err = run_cli(["bench", "reproduce", "--quick", "--workers", "1", "--out", str(tmp_path)], capsys)
    assert code == 130
    assert "bench:" in err  # the bar was drawn
    said = "\ntierserve bench reproduce: interrupted: its results are missing or incomplete\n"
    assert err.endswith(said), err[-300:]
    assert not (tmp_path / "results.json").exists()


def test_the_bench_workers_leave_ctrl_c_to_the_bench() -> None:
    """Ctrl-C reaches the whole process group; each worker raised its own KeyboardInterrupt
    and printed half a traceback ("Process ForkPoolWorker-1:") under the bench's message."""
    import signal

    from tierserve.bench.matrix import _pool_map

    handlers = set(_pool_map(_sigint_handler, [0, 1, 2, 3], workers=2))
    assert handlers == {signal.SIG_IGN}


def _sigint_handler(_item: int) -> object:
    import signal

    return signal.getsignal(signal.SIGINT)


def test_an_interrupted_generate_ends_its_line_of_text_before_saying_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The message was printed on the line of the text streamed so far ("...tierserve
    generate: interrupted")."""
    from tierserve import cli, generate

    def streaming(_args: object) -> int:
        print("partial text", end="", flush=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "run", streaming)
    code = cli.main(["generate", "--prompt", "hi"])
    captured = capsys.readouterr()
    assert code == 130 and captured.out == "partial text\n"
    assert captured.err == "tierserve generate: interrupted\n"


def test_bench_serve_reads_the_tier_mix_as_the_other_benches_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`1e1/60/30/5` (shares in any notation) was refused by a check of its own; `nan` shares
    are refused with `bench fleet`'s words."""
    from tierserve.bench import serve_bench

    def reached(_args: object) -> None:  # the next check: past the tier mix, no server started
        raise ValueError("past the tier mix")

    monkeypatch.setattr(serve_bench, "checked_config", reached)
    _, err = run_cli(
        ["bench", "serve", "--tier-mix", "1e1/60/30/5", "--out", str(tmp_path / "r.json")], capsys
    )
    assert err == "tierserve bench serve: past the tier mix\n"
    code, err = run_cli(["bench", "serve", "--tier-mix", "nan/1/1/1"], capsys)
    assert code == 2
    assert err == "tierserve bench serve: --tier-mix: tier mix: shares must be finite numbers >= 0\n"
