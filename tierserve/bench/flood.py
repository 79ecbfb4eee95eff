"""A flood of large request bodies, for `tierserve bench serve`: what one abusive client does.

`Flood` runs `clients` senders in a child interpreter (off the server's CPUs where the
caller says so), each posting ~1 MiB JSON bodies to `/v1/completions` back to back,
alternating a valid body (a prompt of token ids, far beyond any context: a 400 after it is
parsed) and an invalid one (the same bytes cut short: a 400 for the JSON). Bounded: it
stops when told, after `max_seconds`, or after `max_requests` bodies per client. Loopback
only. The child reports how many bodies it sent and the statuses it got.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# Just under the server's default body limit (1 MiB), so the server reads and parses it all.
BODY_BYTES = (1 << 20) - 4096
MAX_REQUESTS_PER_CLIENT = 10_000


@dataclass
class FloodReport:
    clients: int
    body_bytes: int
    num_sent: int = 0
    statuses: dict[str, int] = field(default_factory=dict)


def bodies(model: str, size: int = BODY_BYTES) -> tuple[bytes, bytes]:
    """A valid body of about `size` bytes (token ids) and an invalid one of the same size."""
    head = json.dumps({"model": model, "max_tokens": 16, "prompt": [0]})[:-2]  # up to '[0'
    ids = ",1234567" * ((size - len(head) - 2) // 8)
    valid = (head + ids + "]}").encode()
    return valid, valid[:-2] + b"  "  # the list and the object left open: not JSON


class Flood:
    """The flood in a child process: `start()`, then `stop()` returns its report."""

    def __init__(self, url: str, model: str, clients: int, max_seconds: float, cpus: set[int] | None) -> None:
        self._clients = clients
        self._job = {"url": url, "model": model, "clients": clients, "max_seconds": max_seconds}
        self._cpus = cpus
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        import tierserve

        root = str(Path(tierserve.__file__).resolve().parents[1])
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
        }
        cpus = self._cpus
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tierserve.bench.flood"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(self._job) + "\n")
        self._proc.stdin.flush()

    def stop(self) -> FloodReport:
        """Tell the child to stop (close its stdin) and read its report."""
        proc = self._proc
        if proc is None:
            raise RuntimeError("the flood was not started")
        out, _ = proc.communicate(timeout=60)  # closes stdin: the child's signal to stop
        report = FloodReport(self._clients, BODY_BYTES)
        if proc.returncode == 0 and out.strip():
            counts = json.loads(out)
            report.num_sent = sum(counts.values())
            report.statuses = dict(sorted(counts.items()))
        return report


def _sender(url: str, body: tuple[bytes, bytes], stop: threading.Event, counts: Counter[str]) -> None:
    import httpx

    with httpx.Client(timeout=30) as http:
        for i in range(MAX_REQUESTS_PER_CLIENT):
            if stop.is_set():
                return
            try:
                r = http.post(url, content=body[i % 2], headers={"content-type": "application/json"})
                counts[str(r.status_code)] += 1
            except httpx.HTTPError as e:
                counts[type(e).__name__] += 1


def _stop_at_eof(stop: threading.Event) -> None:
    sys.stdin.read()  # the parent closes our stdin to stop us
    stop.set()


def _child_main() -> None:
    job = json.loads(sys.stdin.readline())
    stop = threading.Event()
    counts: Counter[str] = Counter()
    body = bodies(job["model"])
    url = job["url"] + "/v1/completions"
    threads = [
        threading.Thread(target=_sender, args=(url, body, stop, counts), daemon=True)
        for _ in range(job["clients"])
    ]
    for t in threads:
        t.start()
    threading.Thread(target=_stop_at_eof, args=(stop,), daemon=True).start()
    deadline = time.monotonic() + job["max_seconds"]
    while not stop.is_set() and time.monotonic() < deadline:
        stop.wait(0.1)
    stop.set()
    for t in threads:
        t.join(timeout=35)
    json.dump(dict(counts), sys.stdout)


if __name__ == "__main__":  # the child process of `Flood`
    _child_main()
