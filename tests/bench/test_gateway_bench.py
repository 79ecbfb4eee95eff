"""`tierserve bench gateway --json`, on the smallest bounded fleet: the keys the issue names."""

from __future__ import annotations

import json

import pytest

from tierserve.cli import main


def test_bench_gateway_prints_overhead_and_per_tier_maps_for_both_arms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "gateway", "--json", "--streams", "4", "--replicas", "1", "--max-seqs", "2"]
    argv += ["--duration", "1.5", "--max-tokens", "4"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert isinstance(result["overhead_p50_ms"], float) and isinstance(result["overhead_p99_ms"], float)
    assert result["capacity_rps"] > 0
    # offered = 1.2 x capacity, with a floor of 0.5 req/s for a very slow host
    assert result["offered_rps"] == pytest.approx(max(0.5, 1.2 * result["capacity_rps"]), abs=0.01)
    for arm in ("flow_control", "least_loaded"):
        tiers = result[arm]
        assert set(tiers) == {"P0", "P1", "P2"}
        assert sum(t["sent"] for t in tiers.values()) >= 1
        for t in tiers.values():
            assert t["slo_attainment"] is None or 0.0 <= t["slo_attainment"] <= 1.0
            assert t["goodput_rps"] >= 0.0
