"""Finding the data folder: $TIERSERVE_DATA, else shared/data beside the repository."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierserve import data_dir
from tierserve.executors.sim.vidur_data import default_data_dir


@pytest.fixture
def beside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for shared/data beside the repository, with no $TIERSERVE_DATA."""
    folder = tmp_path / "shared" / "data"
    monkeypatch.setattr(data_dir, "BESIDE_REPO", folder)
    monkeypatch.delenv(data_dir.DATA_ENV, raising=False)
    return folder


@pytest.fixture
def elsewhere(beside: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty data folder named by $TIERSERVE_DATA (the folder beside stays absent)."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    monkeypatch.setenv(data_dir.DATA_ENV, str(folder))
    return folder


def test_the_folder_beside_the_repository_is_found(beside: Path) -> None:
    assert data_dir.find_data_dir() is None
    (beside / "gpu-profiles").mkdir(parents=True)
    (beside / "trace.csv").write_text("x\n")
    assert data_dir.find_data_dir() == beside
    assert data_dir.data_path("trace.csv") == beside / "trace.csv"
    assert default_data_dir() == beside / "gpu-profiles"


def test_the_environment_variable_wins_even_over_a_folder_beside(
    beside: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    beside.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.setenv(data_dir.DATA_ENV, str(elsewhere))
    assert data_dir.find_data_dir() is None  # a mistyped $TIERSERVE_DATA is not hidden
    elsewhere.mkdir()
    assert data_dir.find_data_dir() == elsewhere
    assert default_data_dir() is None  # no gpu-profiles/ there


def test_missing_data_says_how_to_get_it(beside: Path) -> None:
    with pytest.raises(data_dir.DataNotFoundError, match=f"set {data_dir.DATA_ENV}.*docs/data.md"):
        data_dir.data_path("trace.csv")
    beside.mkdir(parents=True)
    with pytest.raises(data_dir.DataNotFoundError, match=r"trace\.csv is missing"):
        data_dir.data_path("trace.csv")


def test_a_data_variable_naming_no_folder_says_so(
    beside: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not "set TIERSERVE_DATA to a folder", when it is set: the typo is what to fix."""
    monkeypatch.setenv(data_dir.DATA_ENV, str(tmp_path / "typo"))
    with pytest.raises(
        data_dir.DataNotFoundError, match=r"TIERSERVE_DATA is set to .*typo, which is not a folder"
    ):
        data_dir.data_path("trace.csv")


def test_the_repositorys_tests_read_data_from_the_folder_found(shared_data: Path) -> None:
    assert shared_data == data_dir.find_data_dir()
    assert (shared_data / "gpu-profiles").is_dir()


def test_the_bench_reads_its_traces_from_the_folder_found(elsewhere: Path) -> None:
    from tierserve.bench.cell import BenchSetup

    with pytest.raises(data_dir.DataNotFoundError, match=r"AzureLLMInferenceTrace_code\.csv is missing"):
        BenchSetup().trace_rows("azure-code")
    (elsewhere / "AzureLLMInferenceTrace_code.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
    )
    assert len(BenchSetup().trace_rows("azure-code")) == 1


def test_bench_fleet_takes_its_default_trace_from_the_folder_found(elsewhere: Path) -> None:
    from tierserve.bench.fleet_bench import TRACE_FILE, default_trace

    with pytest.raises(data_dir.DataNotFoundError, match="is missing from the data folder"):
        default_trace()
    (elsewhere / TRACE_FILE).write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert default_trace() == elsewhere / TRACE_FILE


def test_a_trace_file_given_by_path_needs_no_data_folder(beside: Path, tmp_path: Path) -> None:
    """`bench reproduce --trace FILE` and `bench sim-speed --workload FILE` refused a user's
    own trace when the data folder was absent (docs/data.md: a trace can be anywhere)."""
    from tierserve.bench.cell import BenchSetup

    assert not beside.exists() and data_dir.find_data_dir() is None
    trace = tmp_path / "mine.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n")
    assert len(BenchSetup().trace_rows(str(trace))) == 1
