"""`tierserve bench sim-speed`: both modes on one small cell, the figures the issue names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierserve.cli import main


def test_sim_speed_reports_both_rates_and_no_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim-speed.json"
    argv = ["bench", "sim-speed", "--load", "8", "--requests", "20", "--repeats", "1", "--json"]
    assert main([*argv, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["max_rel_diff"] == 0.0 and printed["mismatches"] == 0
    assert printed["step_requests_per_cpu_s"] > 0 and printed["fast_requests_per_cpu_s"] > 0
    rate_ratio = printed["fast_requests_per_cpu_s"] / printed["step_requests_per_cpu_s"]
    assert printed["speedup"] == pytest.approx(rate_ratio, rel=0.01)
    assert 0 < printed["leapt_share"] < 1 and printed["num_requests"] >= 20
    # Prompts run in full steps beside the kept decoders (admissions need a full step).
    assert 0 < printed["kept_share"] <= 1 - printed["leapt_share"]


def test_sim_speed_refuses_a_load_of_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "sim-speed", "--load", "0"]) == 2
    assert "--load must be > 0" in capsys.readouterr().err
