"""Large request bodies are validated and tokenized off the event loop (the body parser's
process, a worker thread), one at a time, and for at most `share` of the CPU over a run
(10 % by default), so they cannot take it from token streams; that share is split fairly
among the tenants with large bodies.

Parsing a body holds the interpreter lock for as long as pydantic or the tokenizer runs
(~20 ms for 1 MiB of token ids on the reference host), on whichever thread. A worker
keeps that off the event loop's own turn; the gate also bounds how much of it happens.
`admit` applies the bounds to a job done elsewhere (body_parser.py).

What a job costs is the CPU time it reports (`report_cpu`: the parser process's thread,
a `run` thread), else its wall time; at most its wall time. Two budgets of that time,
refilled as time passes:
- the gate's: `share` seconds a second, at most `BURST_S` banked. No job starts while it
  is below zero, so the jobs' total stays within `share * elapsed + BURST_S`, plus the
  one job that overdrew it;
- each active tenant's (one with a body in the gate, or in debt): the same `share`, split
  evenly among them, at most `BURST_S` banked. A tenant's job starts only when its budget
  is not below zero, and the job's cost is taken from both.
So a tenant pays for its jobs with a rest of its own: one that floods the gate with slow
bodies waits for its part of the share to pay for each, while another, whose bodies are
cheap, is served at its own part meanwhile, about half of its rate alone when there are
two. Among the tenants that may start, the turn goes to the one that has used the least
of the gate (start-time fair queuing over `cost / share`; each tenant's bodies in arrival
order).

Until 2026-12-08 the rest after a job (`t * (1 - share) / share`) was the gate's: no one's
job ran in it. A tenant sending invalid 800 KB bodies (10 ms of CPU each, 18 ms on the
clock on this busy 2-core host) took the gate whenever another, sending valid 200 KB
prompts (2 ms) one after another, had no body waiting (between its parse and its prompt's
preparation, or before its next request), and everyone waited out the rest, 0.16 s.
Served in 20 s, alone and beside 4 connections of the flood (medians of 3, this host,
runs alternated): 373 and 65 before; 295 and 132 with the tenants' own rests; 508 and
292 charged CPU time too. Beside 12 connections, whose extra bodies the server reads
before refusing them (429 `busy_tenant`), taking CPU of its own: 225 and 23 before, 397
and 186 now. Charging wall time had also charged a parse its wait for a CPU, 3x its CPU
time for the cheap prompts beside the flood (10 ms median, 3 ms alone). One FIFO for
all, before the fair queue, had served 2 in 20 s of 127 (an attack trial).

At most `max_waiting` jobs are in the gate (more get a 503 `busy`), and at most
`max_waiting_per_tenant` of one tenant's (more get a 429 `busy_tenant`), so one tenant
cannot fill it either. The tenants tracked are those with a body in the gate or in debt;
a job costs at least `MIN_COST_S` of both budgets, so the debts outstanding, at most the
gate's burst and a job, are held by at most ~(`BURST_S` + a job) / `MIN_COST_S` tenants.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import ParamSpec, TypeVar

from tierserve.server.errors import ApiError

P = ParamSpec("P")
T = TypeVar("T")
BUSY = ("busy", "busy_tenant")  # the codes of the gate's refusals
MIN_COST_S = 0.001  # what a job costs its tenant at the least, so that quick jobs take turns
# Job time the gate, and a tenant waiting for it, may bank: at least two of the largest
# jobs (a 1 MiB body, 20-50 ms here), so that one tenant's job leaves the gate's budget
# enough for another's; the most the jobs may run past `share` after an idle spell.
BURST_S = 0.1
EPSILON_S = 1e-9  # a budget refilled to zero by a sleep of exactly the time it needed
# The CPU time the job holding the gate says it took (`report_cpu`), for its task and the
# threads it starts (they copy the task's context).
_CPU: ContextVar[list[float] | None] = ContextVar("body_gate_cpu", default=None)


def report_cpu(seconds: float) -> None:
    """Say that the gate's job took `seconds` of CPU (its thread's, or the parser process's):
    the gate charges that rather than the job's wall time, when it is less."""
    meter = _CPU.get()
    if meter is not None:
        meter.append(seconds)


class BodyGate:
    def __init__(
        self,
        share: float = 0.1,
        max_waiting: int = 16,
        max_waiting_per_tenant: int | None = None,
        *,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_waiting_per_tenant`: None = `max_waiting` (no cap of its own). `now`: the
        clock (a test's own, moved by its jobs and by a stand-in for `asyncio.sleep`)."""
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
        self._holder: str | None = None  # whose job holds the gate
        # The budgets of job time (seconds; below zero, a debt), as of `_settled`: the
        # gate's, and each active tenant's (a body in the gate, or a debt).
        self._level = BURST_S
        self._balance: dict[str, float] = {}
        self._settled = now()
        self._timer: asyncio.Task[None] | None = None  # wakes the gate when a budget allows
        self.num_jobs = 0

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread, within the gate's share of time."""
        return await self.run_for("", fn, *args, **kwargs)

    async def run_for(self, tenant: str, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`run`, at `tenant`'s turn and charged to it: the CPU time `fn` takes on its thread
        (a large prompt's preparation, charged its wall time until 2026-12-08, paid for a
        busy host's wait for a CPU as the parses had)."""

        def timed() -> T:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                report_cpu(time.thread_time() - start)

        return await self.admit(lambda: asyncio.to_thread(timed), tenant)

    async def admit(self, job: Callable[[], Awaitable[T]], tenant: str = "") -> T:
        """Await `job()` (work done elsewhere: a thread, a process) within the gate's share,
        at `tenant`'s turn."""
        self._refuse_past_the_caps(tenant)
        self._settle()
        self._num_in += 1
        self._num_in_by_tenant[tenant] = self._num_in_by_tenant.get(tenant, 0) + 1
        self._balance.setdefault(tenant, 0.0)  # active: its share of the budget starts now
        try:
            await self._turn(tenant)
            spent = 0.0
            try:
                meter: list[float] = []
                reported = _CPU.set(meter)
                started = self._now()
                try:
                    return await job()
                finally:
                    spent = self._now() - started
                    _CPU.reset(reported)
                    spent = min(spent, sum(meter)) if meter else spent
                    self.num_jobs += 1
            finally:
                self._charge(tenant, spent)
                self._pass_on()
        finally:
            self._num_in -= 1
            left = self._num_in_by_tenant.pop(tenant) - 1
            if left:
                self._num_in_by_tenant[tenant] = left

    async def _turn(self, tenant: str) -> None:
        """Return once `tenant` holds the gate: at once when it is free, no one waits and
        the budgets allow."""
        if self._holder is None and not self._queues and self._may_start(tenant):
            self._hold(tenant)
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(tenant, deque()).append(turn)
        if self._holder is None:
            self._pass_on()  # free, its budgets short: this one may start, or wake it later
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

    def _settle(self) -> None:
        """The budgets refilled to now: the gate's by `share` a second, each active
        tenant's by its even part of it; a tenant with no body in and no debt is dropped."""
        now = self._now()
        elapsed, self._settled = max(0.0, now - self._settled), now
        self._level = min(BURST_S, self._level + elapsed * self._share)
        if not self._balance or not elapsed:
            return
        earned = elapsed * self._share / len(self._balance)
        self._balance = {
            t: min(BURST_S, b + earned)
            for t, b in self._balance.items()
            if b + earned < 0 or t in self._num_in_by_tenant
        }

    def _charge(self, tenant: str, spent: float) -> None:
        """A job's time, from the gate's budget and its tenant's; its fair-queue cost."""
        self._settle()
        self._level -= max(spent, MIN_COST_S)
        self._balance[tenant] = self._balance.get(tenant, 0.0) - max(spent, MIN_COST_S)
        self._finish[tenant] = self._virtual + max(spent, MIN_COST_S) / self._share

    def _may_start(self, tenant: str) -> bool:
        """Whether the budgets let `tenant` start a job now (always, at a share of 1)."""
        if self._share >= 1.0:
            return True
        self._settle()
        return self._level >= -EPSILON_S and self._balance.get(tenant, 0.0) >= -EPSILON_S

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
        waited, on a tie) among those the budgets let start; or free, and woken when the
        first of them may."""
        self._holder = None
        while self._queues:
            ready = [t for t in self._queues if self._may_start(t)]
            if not ready:
                self._wake_later()
                return
            tenant = min(ready, key=lambda t: self._finish.get(t, 0.0))
            queue = self._queues[tenant]
            turn = queue.popleft()
            if not queue:
                del self._queues[tenant]
            if not turn.done():  # else cancelled, its task not yet woken to forget it
                self._hold(tenant)
                turn.set_result(None)
                return

    def _wake_later(self) -> None:
        """Pass the gate on once the first waiting tenant's budget, and the gate's, allow
        (as things stand: a body arriving meanwhile is let in, or not, when it arrives)."""
        rate = self._share / len(self._balance)
        debt = min(-self._balance.get(t, 0.0) for t in self._queues)
        delay = max(debt / rate, -self._level / self._share, 0.0)
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().create_task(self._wake(delay))

    async def _wake(self, delay: float) -> None:
        await asyncio.sleep(delay)
        self._timer = None
        if self._holder is None:
            self._pass_on()

    def _forget(self, tenant: str, turn: asyncio.Future[None]) -> None:
        """A waiting turn given up (its client left): out of its tenant's queue."""
        queue = self._queues.get(tenant)
        if queue is None or turn not in queue:
            return
        queue.remove(turn)
        if not queue:
            del self._queues[tenant]
