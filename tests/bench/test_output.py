"""Results name the commit they came from, and say when the tree was not that commit."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

import pytest

from tierserve.bench.output import source_commit


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_the_commit_is_marked_when_tracked_files_differ_from_it(tmp_path: Path) -> None:
    assert source_commit(tmp_path) is None  # not a checkout
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@example.invalid")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "code.py").write_text("x = 1\n")
    _git(tmp_path, "add", "code.py")
    _git(tmp_path, "commit", "-q", "-m", "first")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert source_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files are not the code\n")
    assert source_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert source_commit(tmp_path) == f"{head}+uncommitted"


def test_a_results_folder_that_cannot_be_written_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only folder passed the check (it exists and is a folder) and failed when the
    results were written, after every run."""
    import errno

    from tierserve.bench.output import make_out_dir, make_out_folder

    make_out_dir(tmp_path / "fine")
    assert list((tmp_path / "fine").iterdir()) == []  # the check leaves nothing behind

    def read_only(self: Path, data: bytes) -> int:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "write_bytes", read_only)
    with pytest.raises(ValueError, match=r"--out .*: cannot write in .*ro \(Read-only file system\)"):
        make_out_dir(tmp_path / "ro")
    with pytest.raises(ValueError, match=r"--out .*results.json: cannot write in .*ro2"):
        make_out_folder(str(tmp_path / "ro2" / "results.json"))  # a JSON file's folder too


def test_input_warnings_keeps_what_the_trace_loader_warns_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tierserve.bench.output import input_warnings
    from tierserve.workloads.traces import load_trace

    seconds = tmp_path / "s.jsonl"
    row = '{"timestamp": %s, "input_length": 10, "output_length": 5}\n'
    seconds.write_text("".join(row % (i * 0.3) for i in range(20)))
    with input_warnings() as warned:
        load_trace(seconds)
    assert len(warned) == 1 and "multiply them by 1000" in warned[0]
    # Printed too: with a handler of its own the logger stopped falling back to stderr, and a
    # run that then stopped on an error lost the warning that explained it.
    assert "multiply them by 1000" in capsys.readouterr().err
    load_trace(tmp_path / "s.jsonl")  # after the block: no longer kept
    assert len(warned) == 1


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_a_second_bench_writing_the_same_out_is_refused_while_the_first_runs(
    tmp_path: Path, kind: str
) -> None:
    """Two `bench serve` runs on the default --out both said "wrote", and the file held only
    the second's results; two `bench reproduce` runs into one folder mixed their files."""
    import sys

    from tierserve.bench.output import make_out_dir, make_out_folder, release_out

    out = tmp_path / ("result.json" if kind == "file" else "results")
    claim = f"make_out_folder({str(out)!r})" if kind == "file" else f"make_out_dir(Path({str(out)!r}))"
    script = (
        "import sys\nfrom pathlib import Path\n"
        "from tierserve.bench.output import make_out_dir, make_out_folder\n"
        f"{claim}\nprint('ready', flush=True)\nsys.stdin.read()\n"
    )
    first = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "ready"
        with pytest.raises(ValueError, match=f"another tierserve bench is writing there .pid {first.pid}."):
            make_out_folder(str(out)) if kind == "file" else make_out_dir(out)
    finally:
        first.communicate("", timeout=30)  # it reads to the end of its input, then exits
    make_out_folder(str(out)) if kind == "file" else make_out_dir(out)  # free once it has ended
    held = subprocess.run([sys.executable, "-c", script], input="", capture_output=True, text=True)
    assert held.returncode != 0 and "another tierserve bench is writing there" in held.stderr
    release_out(out)  # this process's results are written: free for the next
    assert subprocess.run([sys.executable, "-c", script], input="", capture_output=True).returncode == 0


def test_a_lock_that_cannot_be_taken_for_another_reason_does_not_stop_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No locks on that file system (ENOLCK), or a lock file another user made: refusing
    the run for it would stop every bench there; the run goes on unguarded."""
    import errno
    import fcntl

    from tierserve.bench import output

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    output.make_out_folder(str(tmp_path / "r.json"))  # no refusal
    output.make_out_dir(tmp_path / "results")


def test_a_lock_file_removed_meanwhile_is_retaken_and_a_run_leaves_none_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bench that opened the lock file just before its holder released (and removed) it
    held a lock on a file no longer at that path, beside a third bench on the new one; and a
    run that stopped before writing left its lock file in /tmp."""
    import sys

    from tierserve.bench import output

    out = tmp_path / "r.json"
    real_stat, calls = output.os.stat, []

    def removed_once(path: object, *args: object, **kwargs: object) -> object:
        if str(path).endswith(".lock") and not calls:
            calls.append(path)
            Path(str(path)).unlink()  # its holder released and removed it after our open
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(output.os, "stat", removed_once)
    output.make_out_folder(str(out))
    fd, lock = output._claimed[out.resolve()]
    assert calls and real_stat(lock).st_ino == output.os.fstat(fd).st_ino  # the file at that path
    output.release_out(out)
    assert not lock.exists()
    # A run that claims and stops without writing: its lock file goes at exit.
    script = f"from tierserve.bench.output import make_out_folder\nmake_out_folder({str(out)!r})\n"
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0
    assert not lock.exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_off_a_terminal_is_whole_lines_at_an_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierserve.bench import output

    log = io.StringIO()
    with output.progress_bar(total=300, desc="bench", unit="run", out=log) as bar:
        for _ in range(300):
            bar.update()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    # The first line and the last, nothing between within the interval, the last not twice.
    assert len(lines) == 2 and lines[0].startswith("bench:   0%") and "300/300" in lines[-1]
    # A bar left on a terminal is tqdm's own, redrawn in place.
    tty = _Terminal()
    with output.progress_bar(total=3, desc="bench", out=tty) as bar:
        bar.update(3)
    assert "\r" in tty.getvalue() and "3/3" in tty.getvalue()
    # Past the interval, a line at each update.
    monkeypatch.setattr(output, "PROGRESS_LOG_INTERVAL_S", 0.0)
    log = io.StringIO()
    for _ in output.progress_bar(range(4), desc="hf", out=log, miniters=1):
        pass
    assert len(log.getvalue().splitlines()) == 5
    # A bar a terminal would clear at its end (bench engine's) still ends on its last line.
    monkeypatch.setattr(output, "PROGRESS_LOG_INTERVAL_S", 30.0)
    log = io.StringIO()
    for _ in output.progress_bar(range(300), desc="tierserve", out=log, leave=False):
        pass
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "300/300" in lines[-1]
