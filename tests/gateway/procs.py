"""Real processes for the gateway tests: sim upstreams, gateways and a private redis-server.

Every process binds 127.0.0.1 on a free port and is stopped by its own pid.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
MODEL = "llama-3.1-70b"  # the sim backend's default model
READY_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.alive():
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return int(self.popen.returncode)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _spawn(args: list[str], log: Path, port: int) -> Proc:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        popen = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    return Proc(popen, port, log)


def wait_ready(proc: Proc, path: str = "/ready") -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"process exited early:\n{proc.output()}")
        try:
            if httpx.get(proc.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.stop(signal.SIGKILL)
    raise RuntimeError(f"not ready in {READY_TIMEOUT_S} s:\n{proc.output()}")


def start_upstream(tmp: Path, name: str, port: int | None = None) -> Proc:
    port = port or free_port()
    cmd = [sys.executable, "-m", "tierserve.cli", "serve", "--backend", "sim", "--port", str(port)]
    proc = _spawn([*cmd, "--log-level", "warning"], tmp / f"{name}.log", port)
    wait_ready(proc)
    return proc


def start_gateway(tmp: Path, name: str, config: str) -> Proc:
    port = free_port()
    path = tmp / f"{name}.toml"
    path.write_text(config)
    cmd = [sys.executable, "-m", "tierserve.cli", "gateway", "--config", str(path), "--port", str(port)]
    proc = _spawn(cmd, tmp / f"{name}.log", port)
    wait_ready(proc)
    return proc


def start_redis(tmp: Path, port: int | None = None, dump_dir: Path | None = None) -> Proc:
    """A private redis-server; with `dump_dir` it saves its data there on SIGTERM and loads it at start."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server")
    port = port or free_port()
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "no"]
    args += ["--save", "3600 1", "--dir", str(dump_dir)] if dump_dir is not None else ["--save", ""]
    proc = _spawn(args, tmp / f"redis-{port}.log", port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.1)
    proc.stop(signal.SIGKILL)
    raise RuntimeError(f"redis-server did not start:\n{proc.output()}")


@contextmanager
def running(*procs: Proc) -> Iterator[tuple[Proc, ...]]:
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def upstreams_toml(procs: list[Proc], kind: str = "tierserve") -> str:
    return "".join(
        f'\n[[upstreams]]\nname = "u{i}"\nkind = "{kind}"\nurl = "{p.url}"\n' for i, p in enumerate(procs)
    )
