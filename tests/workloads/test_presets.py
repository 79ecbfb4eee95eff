from __future__ import annotations

import pytest

from tierserve.bench.cell import BenchSetup, Cell, run_cell
from tierserve.bench.summary import summarize
from tierserve.workloads import PRESETS, get_preset


def test_memory_pressure_runs_on_fewer_gpus_with_longer_outputs_than_default() -> None:
    default, pressure = get_preset("default"), get_preset("memory-pressure")
    assert pressure.tp < default.tp
    assert pressure.shapes is not None and default.shapes is not None
    for tier in (2, 3):
        assert pressure.shapes[tier].output.high > 2 * default.shapes[tier].output.high  # type: ignore[index]
    with pytest.raises(ValueError, match="memory-pressure"):
        get_preset("nope")
    assert {p.trace_file for p in PRESETS.values() if p.trace_file} == {
        "mooncake_conversation_trace.jsonl",
        "AzureLLMInferenceTrace_code.csv",
    }


@pytest.mark.parametrize("policy", ["fcfs", "hybrid"])
def test_the_memory_pressure_workload_fills_the_kv_cache(policy: str) -> None:
    setup = BenchSetup(num_measured=300, think_time_s=0.5, drain_timeout_s=30.0)
    res = run_cell(setup, Cell("memory-pressure", "closed", 256, policy, 0))
    out = summarize([res], setup.engine_config())
    # hybrid keeps a 15 % floor for P0 that the long lower-tier requests may not fill
    assert out["kv_peak_used"] >= (0.97 if policy == "fcfs" else 0.84)
    pre = out["preemptions"]
    if policy == "fcfs":  # hybrid's step-time bound can keep the full cache from needing any
        assert pre["swap"] + pre["recompute"] > 0
