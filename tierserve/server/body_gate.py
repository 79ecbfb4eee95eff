"""Large request bodies are validated and tokenized on a worker thread, one at a time, and
for at most `share` of the time, so they cannot take the interpreter from token streams.

Parsing a body holds the interpreter lock for as long as pydantic or the tokenizer runs
(~20 ms for 1 MiB of token ids on the reference host), on whichever thread. A worker
thread keeps that off the event loop's own turn; the gate also bounds how often it
happens: after a job that took `t` seconds the next one starts `t * (1 - share) / share`
seconds later, so a client sending large bodies back to back costs other clients at most
`share` of the CPU (10 % by default). `admit` applies the same bounds to a job done
elsewhere (the body parser's process, body_parser.py).

The gate's time is shared fairly among the tenants with bodies waiting (start-time fair
queuing, each tenant's own in arrival order): a job costs its tenant the time it held
the gate, the rest after it included (`t / share`), and the next turn goes to the tenant
that has used the least. One FIFO for all let a tenant that kept 17 connections of
invalid 800 KB bodies in it leave another tenant's valid prompts waiting behind every one
of them (2 served in 20 s instead of 127, an attack trial); turns taken in rotation still
gave it most of the time, its bodies taking ten times as long as the others'. At most
`max_waiting` jobs are in the gate (more get a 503 `busy`), and at most
`max_waiting_per_tenant` of one tenant's (more get a 429 `busy_tenant`), so one tenant
cannot fill it either.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

from tierserve.server.errors import ApiError

P = ParamSpec("P")
T = TypeVar("T")
BUSY = ("busy", "busy_tenant")  # the codes of the gate's refusals
MIN_COST_S = 0.001  # what a job costs its tenant at the least, so that quick jobs take turns


class BodyGate:
    def __init__(
        self,
        share: float = 0.1,
        max_waiting: int = 16,
        max_waiting_per_tenant: int | None = None,
        *,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_waiting_per_tenant`: None = `max_waiting` (no cap of its own)."""
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self._share = share
        self._max_waiting = max_waiting
        self._max_per_tenant = max_waiting if max_waiting_per_tenant is None else max_waiting_per_tenant
        self._now = now
        # Jobs in the gate (the one holding it included), in all and by tenant.
        self._num_in = 0
        self._num_in_by_tenant: dict[str, int] = {}
        # Each tenant's waiting turns, in arrival order; a tenant is here while it has any.
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        # Fair queuing on the gate's time: where each tenant's use ends (kept while it is
        # ahead of `_virtual`, the start of the job holding the gate), and the holder's start.
        self._finish: dict[str, float] = {}
        self._virtual = 0.0
        self._holder: str | None = None  # whose job holds the gate (its rest included)
        self._next_start = 0.0  # `now()` before which no job starts
        self.num_jobs = 0

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread, within the gate's share of time."""
        return await self.admit(lambda: asyncio.to_thread(fn, *args, **kwargs))

    async def admit(self, job: Callable[[], Awaitable[T]], tenant: str = "") -> T:
        """Await `job()` (work done elsewhere: a thread, a process) within the gate's share,
        at `tenant`'s turn."""
        self._refuse_past_the_caps(tenant)
        self._num_in += 1
        self._num_in_by_tenant[tenant] = self._num_in_by_tenant.get(tenant, 0) + 1
        try:
            await self._turn(tenant)
            spent = 0.0
            try:
                pause = self._next_start - self._now()
                if pause > 0:
                    await asyncio.sleep(pause)
                started = self._now()
                try:
                    return await job()
                finally:
                    spent = self._now() - started
                    self._next_start = self._now() + spent * (1 - self._share) / self._share
                    self.num_jobs += 1
            finally:
                self._finish[tenant] = self._virtual + max(spent, MIN_COST_S) / self._share
                self._pass_on()
        finally:
            self._num_in -= 1
            left = self._num_in_by_tenant.pop(tenant) - 1
            if left:
                self._num_in_by_tenant[tenant] = left

    async def _turn(self, tenant: str) -> None:
        """Return once `tenant` holds the gate: at once when it is free and no one waits."""
        if self._holder is None and not self._queues:
            self._hold(tenant)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._pass_on()  # given the turn as it was cancelled: the next one's now
            else:
                self._forget(tenant, turn)
            raise

    def _hold(self, tenant: str) -> None:
        """`tenant`'s job takes the gate; its use starts where it ended, or now if earlier."""
        self._holder = tenant
        self._virtual = max(self._virtual, self._finish.get(tenant, 0.0))
        # A tenant whose use ended before now starts from now: an idle one banks no time.
        self._finish = {t: f for t, f in self._finish.items() if f > self._virtual}

    def _refuse_past_the_caps(self, tenant: str) -> None:
        if self._num_in >= self._max_waiting:
            raise ApiError(
                503,
                "Too many large request bodies are waiting to be parsed; retry shortly.",
                type="server_error",
                code="busy",
                headers={"Retry-After": "1"},
            )
        if self._num_in_by_tenant.get(tenant, 0) >= self._max_per_tenant:
            raise ApiError(
                429,
                f"Too many of this tenant's large request bodies are waiting to be parsed (at most "
                f"{self._max_per_tenant}, server.large_body_queue_per_tenant); retry shortly.",
                type="requests",
                code="busy_tenant",
                headers={"Retry-After": "1"},
            )

    def _pass_on(self) -> None:
        """The gate to the waiting tenant that has used the least of it (the first to have
        waited, on a tie), or free."""
        self._holder = None
        while self._queues:
            tenant = min(self._queues, key=lambda t: self._finish.get(t, 0.0))
            queue = self._queues[tenant]
            turn = queue.popleft()
            if not queue:
                del self._queues[tenant]
            if not turn.done():  # else cancelled, its task not yet woken to forget it
                self._hold(tenant)
                turn.set_result(None)
                return

    def _forget(self, tenant: str, turn: asyncio.Future[None]) -> None:
        """A waiting turn given up (its client left): out of its tenant's queue."""
        queue = self._queues.get(tenant)
        if queue is None or turn not in queue:
            return
        queue.remove(turn)
        if not queue:
            del self._queues[tenant]
