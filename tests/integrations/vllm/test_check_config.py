"""`python -m tierserve.integrations.vllm.check_config`: the plug-in's config checked in a
second, without vLLM, one line either way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tierserve.integrations.vllm.check_config import main

ROOT = Path(__file__).resolve().parents[3]


def test_a_good_file_says_what_the_plugin_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text('[vllm]\npolicy = "wfq"\n[vllm.priority]\n5 = "P0"\n[tiers.P0]\nfloor = 0.2\n')
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert "policy wfq" in out and "5 -> P0" in out and "P0 floor 0.2" in out
    assert "(beyond the ends, the end's tier)" in out  # a priority past them is not the default tier
    assert "0 -> P1 (the default tier), 5 -> P0" in out  # 0 (untagged) was left to be inferred


def test_settings_vllm_decides_get_a_note_each(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config shared with `tierserve serve` may set the scheduler's limits; inside vLLM its
    flags set them, and the check said nothing of it."""
    path = tmp_path / "tiers.toml"
    path.write_text(
        "[scheduler]\nmax_num_seqs = 4\nswap_factor = 0.3\n"
        "enable_prefix_caching = false\ndrr_quantum_tokens = 512\n"
    )
    assert main([str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.count("\n") == 1 and "policy hybrid" in captured.out
    assert captured.err.splitlines() == [
        f"note: {path}: scheduler.max_num_seqs is not read inside vLLM: its --max-num-seqs sets it",
        f"note: {path}: scheduler.enable_prefix_caching is not read inside vLLM: its "
        "--enable-prefix-caching / --no-enable-prefix-caching sets it",
        f"note: {path}: scheduler.swap_factor is not read inside vLLM: vLLM preempts by recomputing "
        "(its KV offloading aside)",
    ]  # drr_quantum_tokens is read: the drr policies size their rounds by it


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[vllm]\ncolour = "red"\n', "vllm.colour: unknown key"),
        ("[tiers.P0]\nfloor = 0.6\nceiling = 1.0\n[tiers.P1]\nfloor = 0.6\n", "over 100%"),
        ('[tiers.P0]\nfloor = "0.1"\n', "tiers.P0.floor: expected a number"),
        ("[vllm\n", "invalid TOML"),
        ("[server]\nport = 1\n", "server: not read by the vLLM plug-in"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, says: str
) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text(text)
    assert main([str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"error: {path}: "), captured.err
    assert says in captured.err


def test_it_reads_tierserve_config_and_runs_as_a_module(tmp_path: Path) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text('[vllm]\npolicy = "nope"\n')
    env = {**os.environ, "TIERSERVE_CONFIG": str(path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "tierserve.integrations.vllm.check_config"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "vllm.policy: unknown policy 'nope'" in done.stderr
    assert "Traceback" not in done.stderr
    env.pop("TIERSERVE_CONFIG")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "TIERSERVE_CONFIG is not set" in done.stderr


def test_the_running_policys_settings_are_said_where_they_differ_from_its_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user could not tell that `[policy.hybrid]` was read at all."""
    path = tmp_path / "tiers.toml"
    path.write_text("[policy.hybrid]\nstep_bound_x_p0 = 0.5\np3_yields = false\n")
    assert main([str(path)]) == 0
    assert "policy hybrid (step_bound_x_p0 0.5, p3_yields False), default tier P1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "code", "says"),
    [
        ('{"tierserve": {"vllm": {"default_tier": "P2"}}}', 0, "--additional-config"),
        ('{"tierserve": {"vllm": {"default_teir": "P2"}}}', 2, "vllm.default_teir: unknown key"),
        ('{"tiersrve": {}}', 2, "did you mean 'tierserve'?"),
        ('{"tiers": {}}', 2, "the plug-in reads its tables under"),
        ("{bad", 2, "--additional-config: invalid JSON"),
        ("[1]", 2, "expected a JSON object"),
    ],
)
def test_additional_config_json_is_checked_as_the_plugin_reads_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, text: str, code: int, says: str
) -> None:
    """Mistakes in `--additional-config` surfaced only once the model had loaded (35-90 s on
    the CPU build), in vLLM's traceback."""
    monkeypatch.delenv("TIERSERVE_CONFIG", raising=False)
    assert main(["--additional-config", text]) == code
    captured = capsys.readouterr()
    said = captured.out if code == 0 else captured.err
    assert said.count("\n") == 1 and says in said, said
    if code == 0:
        assert "default tier P2" in said


def test_additional_config_beside_tierserve_config_is_refused_as_the_plugin_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With $TIERSERVE_CONFIG set the check read the JSON alone and passed a pair the plug-in
    refuses at start."""
    path = tmp_path / "tiers.toml"
    path.write_text('[vllm]\ndefault_tier = "P3"\n')
    monkeypatch.setenv("TIERSERVE_CONFIG", str(path))
    assert main(["--additional-config", '{"tierserve": {"vllm": {"default_tier": "P2"}}}']) == 2
    assert "use one" in capsys.readouterr().err
    assert main(["--additional-config", "{}"]) == 0  # no tierserve key: the file is read
    assert "default tier P3" in capsys.readouterr().out


def test_the_command_line_forms(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIERSERVE_CONFIG", raising=False)
    assert main(["--help"]) == 0 and "--additional-config JSON" in capsys.readouterr().out
    assert main(['--additional-config={"tierserve": {}}']) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "t.toml"), "--additional-config", "{}"]) == 2
    assert "not both" in capsys.readouterr().err
