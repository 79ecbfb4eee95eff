from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize("policy", ["fcfs", "vllm-priority", "hybrid"])
def test_the_memory_pressure_workload_fills_the_kv_cache(policy: str) -> None:
    setup = BenchSetup(num_measured=600, think_time_s=0.5, drain_timeout_s=30.0)
    res = run_cell(setup, Cell("memory-pressure", "closed", 256, policy, 0))
    out = summarize([res], setup.engine_config())
    if policy == "hybrid":
        # hybrid keeps a 15 % floor for P0 that the long lower-tier requests may not fill,
        # and may hold requests back rather than preempt: it fills the rest.
        assert out["kv_peak_used"] >= 0.84
    else:
        assert out["kv_peak_used"] >= 0.97
        pre = out["preemptions"]
        assert pre["swap"] + pre["recompute"] > 0  # the running requests outgrew the cache


def test_a_trace_file_is_a_workload_on_the_default_hardware(tmp_path: Path) -> None:
    trace = tmp_path / "mine.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    preset = get_preset(str(trace))
    assert preset.trace_file == str(trace.resolve()) and preset.shapes is None
    assert (preset.model, preset.gpu, preset.tp) == (PRESETS["default"].model, "a100-80gb", 8)
    with pytest.raises(ValueError, match="no such trace file"):
        get_preset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown workload"):
        get_preset("nonesuch")


def test_a_trace_named_by_its_file_name_points_at_the_data_folders_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path is read from the current folder; docs that named a trace by its file name
    left a new user at "no such trace file" with the trace in the data folder."""
    from tierserve.workloads.traces import load_trace

    data, here = tmp_path / "data", tmp_path / "here"
    data.mkdir()
    here.mkdir()
    (data / "mine.jsonl").write_text('{"timestamp": 0, "input_length": 8, "output_length": 2}\n')
    monkeypatch.setenv("TIERSERVE_DATA", str(data))
    monkeypatch.chdir(here)
    for call in (get_preset, load_trace):
        with pytest.raises((ValueError, FileNotFoundError), match=r"the data folder has .*data/mine\.jsonl"):
            call("mine.jsonl")
    with pytest.raises(ValueError, match=r"no such trace file$"):  # not in the data folder either
        get_preset("other.jsonl")


def test_a_file_here_that_is_no_trace_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file in the working folder with another suffix was an "unknown workload", and
    /dev/null "no such trace file": what `load_trace` says of them is said here too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trace.txt").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match=r"trace\.txt: unknown trace format"):
        get_preset("trace.txt")
    with pytest.raises(ValueError, match="not a regular file"):
        get_preset("/dev/null")
