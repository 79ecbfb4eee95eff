"""How a benchmark command hands back its result: JSON to a file, and JSON or a table to stdout."""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TRACE_LOGGER = "tierserve.workloads.traces"


@contextmanager
def input_warnings() -> Iterator[list[str]]:
    """The WARNING lines the trace loader logs meanwhile (a unit that looks misread, rows
    skipped), printed on stderr and kept for results.json and report.md: stderr scrolls
    past with the progress bars, and a report read later said nothing of them. (Printed
    here: with a handler of its own the logger no longer falls back to stderr, and a run
    that then stopped on an error lost the warning that explained it.)"""
    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            lines.append(message)
            print(message, file=sys.stderr)

    handler = _Keep(level=logging.WARNING)
    logger = logging.getLogger(TRACE_LOGGER)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def make_out_folder(out: str | None) -> None:
    """Make the folder of the result file `out` now, so that a path that cannot be written
    fails before the benchmark runs rather than after (OSError, or ValueError for a folder)."""
    if out:
        # "results/" names a folder, even one not made yet (Path drops the slash, and the
        # result was written to a file called "results").
        if Path(out).is_dir() or out.endswith(("/", os.sep)):
            raise ValueError(f"--out {out} is a folder: name the JSON file to write")
        with _naming_out(out):
            Path(out).parent.mkdir(parents=True, exist_ok=True)
        _check_writable(Path(out).parent, out)
        _claim(Path(out), out)


def _check_writable(folder: Path, out: str | Path) -> None:
    """Write and remove a file in `folder`: one that exists but cannot be written (read-only,
    another user's) failed only when the results were written, after every run."""
    probe = folder / f".tierserve-write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write in {folder} ({e.strerror or e})") from e


def make_out_dir(out: Path) -> None:
    """Make the results folder `out` now, and write a file in it (see `make_out_folder`)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    with _naming_out(out):
        out.mkdir(parents=True, exist_ok=True)
    _check_writable(out, out)
    _claim(out, out)


_claimed: dict[Path, tuple[int, Path]] = {}  # the outputs this process writes: (lock fd, lock file)


def _claim(path: Path, out: str | Path) -> None:
    """Hold a lock on `path` (a file or folder to write) until `release_out` or the end of
    this process, or refuse it: two benches writing one --out at once each said "wrote",
    over the other's results. The lock file lives in the temporary folder, named by the
    user and the path, not beside the results. A lock that cannot be taken for any other
    reason (no locks on that file system) is not a refusal: the run goes on unguarded."""
    key = path.resolve()
    if key in _claimed:
        return
    digest = hashlib.sha256(str(key).encode()).hexdigest()[:16]
    lock = Path(tempfile.gettempdir()) / f"tierserve-out-{os.getuid()}-{digest}.lock"
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            whom = f"pid {holder}" if holder else "its pid not written yet"
            raise ValueError(f"--out {out}: another tierserve bench is writing there ({whom})") from None
        return
    try:
        current = os.stat(lock).st_ino
    except OSError:
        current = None
    if current != os.fstat(fd).st_ino:  # released and removed meanwhile: lock the new file
        os.close(fd)
        _claim(path, out)
        return
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    if not _claimed:
        atexit.register(_release_all)
    _claimed[key] = (fd, lock)


def _release_all() -> None:
    """At exit, the locks of a run that stopped before its results were written."""
    for path in list(_claimed):
        release_out(path)


def release_out(path: str | Path) -> None:
    """The results at `path` are written: another bench may write there now (the lock taken
    by `make_out_folder` or `make_out_dir`; an in-process caller, a test, may run twice).
    The lock file goes too: a bench that opened it just before finds, once it holds the
    lock, that the file is no longer the one at that path, and locks the new one."""
    claimed = _claimed.pop(Path(path).resolve(), None)
    if claimed is not None:
        fd, lock = claimed
        lock.unlink(missing_ok=True)
        os.close(fd)


@contextmanager
def _naming_out(out: str | Path) -> Iterator[None]:
    """An OS error making the folder said as --out's (it named only a path, e.g. a parent
    under /proc, and not which argument to change)."""
    try:
        yield
    except FileExistsError as e:  # a file where a folder of the path should be
        raise ValueError(f"--out {out}: cannot make its folder ({os.strerror(errno.ENOTDIR)})") from e
    except OSError as e:
        raise ValueError(f"--out {out}: cannot make its folder ({e.strerror or e})") from e


def emit(result: dict[str, Any], out: str | None, as_json: bool, print_table: Callable[[], None]) -> None:
    """Write `result` as JSON to `out` (if given; its folder is made), then print the JSON
    (`as_json`) or the table, and where the file went."""
    text = json.dumps(result, indent=2)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        release_out(path)
    if as_json:
        print(text)
        return
    print_table()
    if out:
        print(f"wrote {out}")


PROGRESS_LOG_INTERVAL_S = 30.0  # between progress lines where stderr is not a terminal


class _Lines(io.TextIOBase):
    """A progress bar's redraws as whole lines: on a log or a CI console a bar redrawn ten
    times a second is one line of thousands of '\\r'-separated copies (1.9 KB for 30 steps)."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._last = ""

    def write(self, s: str) -> int:
        text = s.replace("\r", "").strip()
        # The close redraws the last count (with a new rate in its "[...]" tail): not again.
        if text and (count := text.rpartition(" [")[0] or text) != self._last:
            self._last = count
            self._out.write(text + "\n")
            self._out.flush()
        return len(s)

    def flush(self) -> None:
        self._out.flush()


def progress_bar(iterable: Any = None, *, out: IO[str] | None = None, **kwargs: Any) -> Any:
    """A tqdm bar on stderr (or `out`) where it is a terminal; elsewhere a plain line of
    progress every PROGRESS_LOG_INTERVAL_S and at the end. `kwargs` go to tqdm."""
    from tqdm import tqdm

    out = sys.stderr if out is None else out
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        return tqdm(iterable, file=out, **kwargs)
    # The last line stays (`leave`): off a terminal nothing is redrawn over it.
    kwargs = {"mininterval": PROGRESS_LOG_INTERVAL_S, "ascii": True, **kwargs, "leave": True}
    return tqdm(iterable, file=_Lines(out), **kwargs)


def source_commit(checkout: Path | None = None) -> str | None:
    """The short commit of the checkout this code runs from (or of `checkout`), for the
    results, with "+uncommitted" when tracked files differ from it (the figures are then
    not that commit's); None outside git."""
    import subprocess

    here = checkout or Path(__file__).parent

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here)

    try:
        commit = git("rev-parse", "--short", "HEAD").stdout.strip()
        changed = commit and git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    except OSError:
        return None
    if not commit:
        return None
    return f"{commit}+uncommitted" if changed else commit
