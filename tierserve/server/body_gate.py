"""Large request bodies are validated and tokenized on a worker thread, one at a time, and
for at most `share` of the time, so they cannot take the interpreter from token streams.

Parsing a body holds the interpreter lock for as long as pydantic or the tokenizer runs
(~20 ms for 1 MiB of token ids on the reference host), on whichever thread. A worker
thread keeps that off the event loop's own turn; the gate also bounds how often it
happens: after a job that took `t` seconds the next one starts `t * (1 - share) / share`
seconds later, so a client sending large bodies back to back costs other clients at most
`share` of the CPU (10 % by default). At most `max_waiting` jobs wait; more get a 503.
`admit` applies the same bounds to a job done elsewhere (the body parser's process,
body_parser.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from tierserve.server.errors import ApiError

P = ParamSpec("P")
T = TypeVar("T")


class BodyGate:
    def __init__(self, share: float = 0.1, max_waiting: int = 16) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self._share = share
        self._max_waiting = max_waiting
        self._lock = asyncio.Lock()
        self._num_waiting = 0
        self._next_start = 0.0  # time.monotonic() before which no job starts
        self.num_jobs = 0

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread, within the gate's share of time."""
        return await self.admit(lambda: asyncio.to_thread(fn, *args, **kwargs))

    async def admit(self, job: Callable[[], Awaitable[T]]) -> T:
        """Await `job()` (work done elsewhere: a thread, a process) within the gate's share."""
        if self._num_waiting >= self._max_waiting:
            raise ApiError(
                503,
                "Too many large request bodies are waiting to be parsed; retry shortly.",
                type="server_error",
                code="busy",
                headers={"Retry-After": "1"},
            )
        self._num_waiting += 1
        try:
            async with self._lock:
                pause = self._next_start - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
                started = time.monotonic()
                try:
                    return await job()
                finally:
                    spent = time.monotonic() - started
                    self._next_start = time.monotonic() + spent * (1 - self._share) / self._share
                    self.num_jobs += 1
        finally:
            self._num_waiting -= 1
