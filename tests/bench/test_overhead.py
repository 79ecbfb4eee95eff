from __future__ import annotations

import json

import pytest

from tierserve.bench.overhead import measure
from tierserve.cli import main


def test_overhead_measure_keeps_the_requested_backlog() -> None:
    result = measure("hybrid", num_running=32, num_waiting=300, num_passes=20)
    assert result["running"] == 32
    assert result["waiting"] == 300
    assert 0 < result["schedule_us_p50"] <= result["schedule_us_p99"]


def test_overhead_cli_prints_json_for_each_policy(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "bench",
            "overhead",
            "--running",
            "16",
            "--waiting",
            "100",
            "--passes",
            "5",
            "--policies",
            "wfq",
            "vllm-priority",
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["policies"]) == {"wfq", "vllm-priority"}
    for entry in data["policies"].values():
        assert {"schedule_us_p50", "schedule_us_p99"} <= set(entry)


def test_overhead_cli_rejects_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overhead", "--policies", "lottery", "--passes", "1"]) == 2
    assert "unknown policy" in capsys.readouterr().err


def test_a_policy_named_twice_is_measured_once(capsys: pytest.CaptureFixture[str]) -> None:
    """The table printed two lines for it and the JSON kept the second run's figures."""
    args = ["bench", "overhead", "--running", "1", "--waiting", "0", "--passes", "1", "--policies"]
    assert main([*args, "fcfs", "wfq", "fcfs"]) == 0
    table = capsys.readouterr().out
    assert sum(line.split()[:1] == ["fcfs"] for line in table.splitlines()) == 1
