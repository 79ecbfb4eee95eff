"""`make run` and the first install, read with `make -n` (nothing is run or installed)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(*args: str) -> list[str]:
    out = subprocess.run(
        ["make", "-n", "-B", "-C", str(REPO), "--no-print-directory", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.splitlines()


def test_make_run_serves_on_the_port_and_host_given() -> None:
    serve = [line for line in dry_run("run", "PORT=9123", "HOST=0.0.0.0") if " serve " in line]
    assert serve == [".venv/bin/tierserve serve --host 0.0.0.0 --port 9123"]


def test_make_run_defaults_to_loopback_port_8000() -> None:
    serve = [line for line in dry_run("run") if " serve " in line]
    assert serve == [".venv/bin/tierserve serve --host 127.0.0.1 --port 8000"]


def test_the_first_install_says_what_it_does_and_shows_pips_progress() -> None:
    lines = dry_run("install")
    pip = [line for line in lines if "pip install" in line]
    assert len(pip) >= 2
    assert not any(" -q" in line or "--quiet" in line for line in pip)
    first_pip = lines.index(pip[0])
    assert any("few minutes" in line for line in lines[:first_pip])
