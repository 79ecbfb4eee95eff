"""Local processes for `tierserve bench gateway`: sim upstreams and a gateway on free ports.

Each runs `python -m tierserve.cli` from this same source tree, binds 127.0.0.1 and is
stopped by its own pid when the context ends, also when this process is sent SIGTERM (as
`timeout` and CI runners stop a job) inside it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import FrameType

import httpx

import tierserve

READY_TIMEOUT_S = 90.0


class FleetStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _process(args: list[str], port: int, log: Path) -> Iterator[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(tierserve.__file__).resolve().parents[1])}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierserve.cli", *args], env=env, stdout=out, stderr=out
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise FleetStartError(
                    f"{args[0]} did not become ready:\n{log.read_text(errors='replace')[-2000:]}"
                )
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
    raise SystemExit(128 + signum)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Inside the block, SIGTERM raises SystemExit, so that the contexts above stop the
    processes they started; by default it ends this process at once and leaves them running,
    holding their ports. Only the main thread can set a handler: elsewhere, nothing changes."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


@contextmanager
def local_fleet(
    num_replicas: int, engine_toml: str, gateway_tomls: dict[str, str], policy: str = "hybrid"
) -> Iterator[dict[str, str]]:
    """Start the replicas (with `engine_toml` and scheduling `policy`), then one gateway per
    entry of `gateway_tomls` (its [gateway] text; the replicas are appended as [[upstreams]],
    first come first served for fcfs). Yields name -> URL ("u0", "u1", ... and the gateways')."""
    with (
        _sigterm_unwinds(),
        tempfile.TemporaryDirectory(prefix="tierserve-fleet-") as tmp,
        ExitStack() as stack,
    ):
        root = Path(tmp)
        engine = root / "engine.toml"
        engine.write_text(engine_toml)
        urls: dict[str, str] = {}
        for i in range(num_replicas):
            port = free_port()
            args = [
                "serve",
                "--backend",
                "sim",
                "--port",
                str(port),
                "--config",
                str(engine),
                "--log-level",
                "warning",
                "--policy",
                policy,
            ]
            urls[f"u{i}"] = stack.enter_context(_process(args, port, root / f"u{i}.log"))
        order = 'order = "fifo"\n' if policy == "fcfs" else ""
        ups = "".join(
            f'\n[[upstreams]]\nname = "{name}"\nkind = "tierserve"\nurl = "{url}"\n{order}'
            for name, url in urls.items()
        )
        for name, text in gateway_tomls.items():
            path = root / f"{name}.toml"
            path.write_text(text + ups)
            port = free_port()
            args = ["gateway", "--config", str(path), "--port", str(port), "--log-level", "warning"]
            urls[name] = stack.enter_context(_process(args, port, root / f"{name}.log"))
        yield urls
