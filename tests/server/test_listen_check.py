"""`tierserve serve` on an address it cannot listen on: one line before the model loads."""

from __future__ import annotations

import socket

import pytest

from tierserve.cli import main
from tierserve.server.listen_check import cannot_listen


def test_a_port_in_use_is_refused_and_a_free_one_is_not() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        problem = cannot_listen("127.0.0.1", port)
        assert problem is not None and f"127.0.0.1:{port}" in problem and "another --port" in problem
    assert cannot_listen("127.0.0.1", port) is None  # closed: free again
    assert cannot_listen("127.0.0.1", 0) is None


def test_an_address_of_another_machine_is_refused() -> None:
    problem = cannot_listen("192.0.2.1", 8000)  # TEST-NET-1: on no interface here; no packet is sent
    assert problem is not None and "not an address of this machine" in problem


def test_serve_on_a_port_in_use_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--backend", "sim", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"tierserve serve: cannot listen on 127.0.0.1:{port}")
    assert "(make run PORT=...)" in err  # `make run` starts `serve` (and only `serve`)


def test_a_start_up_error_is_the_only_line_even_on_an_open_server() -> None:
    # The open server's WARNING (no --config) came first, so the error was the second line.
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "tierserve.cli", "serve", "--backend", "sim", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()], done.stderr
    assert done.stderr.startswith(f"tierserve serve: cannot listen on 127.0.0.1:{port}")
