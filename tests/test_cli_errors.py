"""Every `tierserve` command fails with one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tierserve import cli
from tierserve.executors.sim import profile_cli

try:
    import torch

    HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a dependency
    HAS_CUDA = False

MISSING = "/nonexistent/tierserve-test/file"
TINY_TRACE = "/tiny-trace.jsonl"  # replaced by a three-row trace the test writes (no data folder needed)
# Their --out is a folder; the others take a file, and an empty one writes none.
BENCHES_WRITING_A_FOLDER = [["bench", c] for c in ("reproduce", "fleet", "vllm")]
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="this torch build sees a CUDA device")


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's usage errors
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "status", "words"),
    [
        ([], 2, "required: COMMAND"),
        (["frob"], 2, "invalid choice: 'frob'"),
        (["serve", "--port", "99999"], 2, "port number 0-65535"),
        (["serve", "--policy", "lottery"], 2, "invalid choice: 'lottery'"),
        (["serve", "--config", MISSING], 2, "no such config file"),
        (["serve", "--backend", "sim", "--model", "gpt-9"], 2, "unknown model 'gpt-9'"),
        (["generate", "--prompt", "x", "--max-tokens", "0"], 2, "--max-tokens: expected an integer >= 1"),
        (["generate", "--model", MISSING, "--prompt", "x"], 2, "not a directory"),
        (["generate", "--prompt", "x", "--temperature", "1e9"], 2, "from 0 to 2"),  # the API's limit
        pytest.param(["generate", "--device", "cuda", "--prompt", "x"], 2, "no CUDA device", marks=cpu_only),
        (["profile", "--model", "gpt-9", "--gpu", "h200"], 2, "known models"),
        (["profile", "--model", "llama-3.1-70b", "--gpu", "h100-80gb"], 1, "does not fit"),
        (["profile", "--model", "demo", "--gpu", "h200", "--mem-util", "2"], 2, "--mem-util"),
        (["bench", "frob"], 2, "invalid choice: 'frob'"),
        (["bench", "serve", "--policy", "lottery"], 2, "invalid choice: 'lottery'"),
        (["bench", "serve", "--requests", "2", "--config", MISSING], 2, "no such config file"),
        (["bench", "serve", "--requests", "2", "--gpu", "tpu"], 2, "unknown GPU 'tpu'"),
        (["bench", "serve", "--tier-mix", "1/2"], 2, "--tier-mix"),
        # Bounds past which virtual time stretches until TTFTs read 0.0 s, or a bursty cell
        # does not offer the load it is labelled with; a mix whose total overflows crashed mid-run
        (["bench", "reproduce", "--think-time", "1e20"], 2, "--think-time must be 0 to 86400 s"),
        (["bench", "sim-speed", "--think-time", "1e20"], 2, "--think-time must be 0 to 86400 s"),
        (["bench", "reproduce", "--loads", "1e-15"], 2, "--loads must be 0.001 to 1000 times capacity"),
        (["bench", "reproduce", "--patterns", "bursty", "--burst-cv", "100"], 2, "at most 16, got 100"),
        (["bench", "reproduce", "--tier-mix", "1e308/1e308/1/1"], 2, "add up past what a float holds"),
        (["bench", "serve", "--requests", "0"], 2, "--requests"),
        # An empty --out wrote the results into the current folder
        *(([*cmd, "--out", ""], 2, "--out: expected a path, got ''") for cmd in BENCHES_WRITING_A_FOLDER),
        # Each flag named alone (one line listed all three bounds), checked before a server starts:
        (["bench", "serve", "--concurrency", "5000"], 2, "need 1 <= --concurrency <= 2000, got 5000"),
        (
            ["bench", "serve", "--duration-s", "1e7"],
            2,
            "--duration-s <= 86400 (a day), got 1e+07",
        ),  # a timeout
        (["bench", "serve", "--model", ""], 2, "--model: expected a model name"),  # fell back to the default
        (["bench", "serve", "--gpu", " "], 2, "--gpu: expected a GPU name, got ' '"),
        (["bench", "serve", "--prompt-tokens", "200000-200001"], 2, "more than llama-3.1-70b's context of"),
        (["bench", "serve", "--prompt-tokens", "9-3"], 2, "LO-HI"),
        pytest.param(
            ["bench", "engine", "--device", "cuda", "--skip-hf"], 2, "no CUDA device", marks=cpu_only
        ),
        (["bench", "engine", "--prompt-tokens", "300", "20"], 2, "MIN <= MAX"),
        (["bench", "engine", "--num-prompts", "many"], 2, "--num-prompts: expected an integer from 1 to"),
        # 100,000 threads crashed torch (a segfault), 10,000 hung it
        (["bench", "engine", "--threads", "100000"], 2, "--threads: expected 0 (torch's default) to"),
        (["bench", "sim-check", "--threads", "100000"], 2, "--threads: expected 0 (torch's default) to"),
        (["bench", "engine", "--lengths-from", MISSING], 2, "--lengths-from"),
        (["bench", "overhead", "--running", "0"], 2, "--running: expected an integer >= 1"),
        (["bench", "overhead", "--policies", "lottery"], 2, "unknown policy 'lottery'"),
        (["bench", "reproduce", "--policies", "lottery"], 2, "unknown policies lottery"),
        (["bench", "reproduce", "--trace", MISSING], 2, "no such trace file"),
        (["bench", "reproduce", "--seed", "x"], 2, "--seed"),
        (["bench", "reproduce", "--requests", "0"], 2, "--requests: expected an integer from 1 to 1,000,000"),
        (["bench", "reproduce", "--trace-rows", "-1"], 2, "--trace-rows: expected an integer >= 1"),
        (["bench", "reproduce", "--loads", "nan"], 2, "--loads: expected a finite number > 0"),
        (["bench", "reproduce", "--trace-scale", "inf"], 2, "--trace-scale: expected a finite number > 0"),
        (["bench", "reproduce", "--drain-timeout", "0"], 2, "--drain-timeout: expected a finite number > 0"),
        (["bench", "reproduce", "--workers", "0"], 2, "--workers: expected an integer >= 1"),
        (["bench", "fleet", "--rate-scale", "nan"], 2, "--rate-scale: expected a finite number > 0"),
        (["bench", "fleet", "--bin-s", "0"], 2, "--bin-s: expected a finite number > 0"),
        (["bench", "fleet", "--max-requests", "-1"], 2, "--max-requests: expected an integer >= 1"),
        (["bench", "fleet", "--kill", "abc"], 2, "--kill: expected T[@I]"),
        (["bench", "fleet", "--kill", "-5"], 2, "--kill: expected T >= 0"),
        (["bench", "fleet", "--router", "nope"], 2, "tierserve bench fleet: --router: choose from"),
        (["bench", "fleet", "--autoscale", "nope"], 2, "tierserve bench fleet: --autoscale: choose from"),
        (
            ["bench", "fleet", "--replicas", "2", "--kill", "10@5"],
            2,
            "replica 5 (its replicas are numbered 0 to 1)",
        ),
        (["bench", "fleet", "--startup-delay-s", "-1"], 2, "--startup-delay-s: expected a finite"),
        (["bench", "fleet", "--scale-interval-s", "0"], 2, "--scale-interval-s: expected a finite"),
        (["bench", "fleet", "--scale-by", "users"], 2, "--scale-by: invalid choice: 'users'"),
        (["bench", "overhead", "--running", "100000"], 2, "--running: expected at most 16384"),
        (["serve", "--max-header-bytes", "10"], 2, "--max-header-bytes: expected an integer >= 1024"),
        (
            ["serve", "--model", "llama-3.1-8b"],
            2,
            "names a simulated model, which has no weights: `tierserve serve --backend sim`",
        ),
        # `generate` and `bench engine` have no --backend: the hint names the command that has one.
        (
            ["generate", "--model", "llama-3.1-8b", "--prompt", "x"],
            2,
            "`tierserve serve --backend sim` runs it",
        ),
        (["bench", "engine", "--model", "llama-3.1-8b"], 2, "`tierserve serve --backend sim` runs it"),
        # Checked before a checkpoint is written or an engine started (it failed late, a
        # traceback squeezed into a line, when vLLM was missing from the python it ran).
        (["bench", "vllm", "--vllm-python", MISSING, "--out", MISSING], 2, "--vllm-python"),
        (["bench", "vllm", "--vllm-python", sys.executable, "--out", MISSING], 2, "make install-vllm"),
        (["bench", "reproduce", "--max-num-batched-tokens", "1"], 2, "must be >= max_num_seqs (256)"),
        (
            ["bench", "fleet", "--autoscale", "tier", "--min-replicas", "5", "--max-replicas", "2"],
            2,
            "--min-replicas 5 exceeds --max-replicas 2",
        ),
        (["generate", "--prompt", "x", "--device", "tpu"], 2, "--device: expected cpu, cuda or cuda:N"),
        (["generate", "--prompt", "x", "--temperature", "nan"], 2, "from 0 to 2, got nan"),
        (["bench", "sim-speed", "--load", "1.5"], 2, "whole number of clients, got 1.5"),
        # A subcommand's unknown flag points at that subcommand's help, not the top one's.
        (
            ["serve", "--prot", "18580"],
            2,
            "tierserve serve: error: unrecognized arguments: --prot 18580 (see tierserve serve --help)",
        ),
        (
            ["bench", "fleet", "--bogus"],
            2,
            "unrecognized arguments: --bogus (see tierserve bench fleet --help)",
        ),
        (["bench", "sim-check", "--shape", "zz"], 2, "shape 'zz'"),
        # The folder that cannot be made is said as --out's (the OS error named only a path).
        (
            ["bench", "serve", "--out", "/proc/tierserve/x.json"],
            2,
            "--out /proc/tierserve/x.json: cannot make",
        ),
        (
            ["bench", "sim-check", "--out", "/proc/tierserve/x.json"],
            2,
            "--out /proc/tierserve/x.json: cannot",
        ),
        (
            ["bench", "fleet", "--trace", TINY_TRACE, "--out", "/proc/tierserve/x"],
            2,
            "--out /proc/tierserve/x: cannot make its folder",
        ),
        (
            ["bench", "reproduce", "--trace", TINY_TRACE, "--out", "/proc/tierserve/x"],
            2,
            "--out /proc/tierserve/x: cannot make its folder",
        ),
        (
            ["bench", "sim-speed", "--workload", TINY_TRACE, "--out", "/proc/tierserve/x.json"],
            2,
            "--out /proc/tierserve/x.json: cannot",
        ),
        # Abbreviations are not taken: --out was read as --output-tokens.
        (["bench", "engine", "--out", "/proc/x"], 2, "unrecognized arguments: --out /proc/x"),
        (["bench", "sim-speed", "--out", "/"], 2, "--out / is a folder: name the JSON file"),
        # A folder not made yet: the result was written to a file named after it.
        (["bench", "sim-speed", "--out", MISSING + "/"], 2, "/ is a folder: name the JSON file"),
        (["bench", "sim-check", "--device", "foo"], 2, "device must be cpu or cuda, got 'foo'"),
        (["bench", "sim-speed", "--seed", "-5"], 2, "--seed"),
        (["serve", "--max-headers", "0"], 2, "argument --max-headers: expected an integer >= 1"),
        (["serve", "--backend", "sim", "--device", "cuda"], 2, "--device applies to --backend torch"),
        (["serve", "--tp", "2"], 2, "--tp applies to --backend sim, not torch"),
        (
            ["serve", "--backend", "sim", "--kv-cache-gib", "1"],
            2,
            "--kv-cache-gib applies to --backend torch",
        ),
        (["serve", "--kv-cache-gib", "0"], 2, "--kv-cache-gib"),
        (["generate", "--prompt", "x", "--kv-cache-gib", "100000"], 2, "GiB is more than the"),
        (["gateway", "--config", "x.toml", "--body-timeout", "-1"], 2, "argument --body-timeout"),
        (["bench", "reproduce", "--seed", "0", "-1"], 2, "--seed"),
        (
            ["bench", "reproduce", "--quick", "--out", "/dev/null"],
            2,
            "--out /dev/null exists and is not a folder",
        ),
        (["serve", "--config", "/"], 2, "/: a folder, not a config file"),
        (["bench", "sim-check", "--model", "gpt-9"], 2, "gpt-9"),
        # Counts past what runs in minutes: silent for minutes, or memory filling at 130 MB/s.
        (["bench", "overhead", "--waiting", "100000000"], 2, "from 0 to 1,000,000"),
        (["bench", "overhead", "--passes", "99999999999999999999999"], 2, "from 1 to 1,000,000"),
        (["bench", "engine", "--num-prompts", "100000000"], 2, "from 1 to 100,000"),
        (["bench", "engine", "--flood", "100000000"], 2, "from 1 to 100,000"),
        (["bench", "sim-speed", "--load", "1e9"], 2, "at most 100,000 closed-loop clients"),
        (["bench", "reproduce", "--clients", "100000000"], 2, "from 1 to 100,000"),  # 1.7 GB in 25 s
        (["bench", "reproduce", "--trace", TINY_TRACE, "--clients", "8"], 2, "only traces run"),
        (["bench", "reproduce", "--requests", "100000000"], 2, "from 1 to 1,000,000"),
        (["bench", "sim-speed", "--requests", "100000000"], 2, "from 1 to 1,000,000"),
        # A think time a trace ignored, unrecorded; a negative seed that repeated its absolute value.
        (["bench", "sim-speed", "--workload", TINY_TRACE, "--think-time", "5"], 2, "--think-time applies"),
        (["bench", "serve", "--seed", "-1"], 2, "--seed"),
        (["bench", "gateway", "--seed", "-1"], 2, "--seed"),
        (["bench", "gateway", "--duration", "1e-9"], 2, "at least 1 (seconds)"),  # goodput 10^9/s
        pytest.param(["bench", "sim-check", "--device", "cuda"], 2, "no CUDA device", marks=cpu_only),
    ],
)
def test_a_bad_command_line_is_one_line_and_a_non_zero_exit(
    argv: list[str], status: int, words: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "tiny-trace.jsonl"
    trace.write_text(
        "".join(f'{{"timestamp": {ms}, "input_length": 64, "output_length": 4}}\n' for ms in (0, 5, 9))
    )
    argv = [a.replace(MISSING, str(tmp_path / "missing")).replace(TINY_TRACE, str(trace)) for a in argv]
    code, err = run_cli(argv, capsys)
    assert code == status
    assert len(err.strip().splitlines()) == 1, err
    assert words in err and "Traceback" not in err


def test_an_unexpected_failure_is_one_line_with_a_way_to_see_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(_args: argparse.Namespace) -> int:
        raise RuntimeError("the engine\nfell over")

    monkeypatch.setattr(profile_cli, "run", broken)  # `register` reads it when the parser is built
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    code, err = run_cli(["profile", "--model", "demo", "--gpu", "h200"], capsys)
    assert code == 1
    hint = f"({cli.DEBUG_ENV}=1 shows the traceback)"
    assert err == f"tierserve profile: failed: RuntimeError: the engine fell over {hint}\n"
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(RuntimeError):
        cli.main(["profile", "--model", "demo", "--gpu", "h200"])


def test_the_installed_command_prints_no_traceback() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tierserve.cli", "bench", "serve", "--requests", "2", "--model", "gpt-9"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "unknown model 'gpt-9'" in proc.stderr
