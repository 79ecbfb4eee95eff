"""The gate that parses large bodies: off the event loop, one at a time, within its share."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

from tierserve.server import body_gate
from tierserve.server.body_gate import BodyGate
from tierserve.server.errors import ApiError


def test_jobs_run_off_the_event_loop_thread_one_at_a_time() -> None:
    gate = BodyGate(share=1.0)
    running: list[int] = []
    overlaps: list[int] = []
    loop_thread = threading.get_ident()

    def job(i: int) -> int:
        running.append(i)
        overlaps.append(len(running))
        time.sleep(0.01)
        running.remove(i)
        return threading.get_ident()

    async def main() -> list[int]:
        return await asyncio.gather(*(gate.run(job, i) for i in range(5)))

    threads = asyncio.run(main())
    assert loop_thread not in threads
    assert max(overlaps) == 1 and gate.num_jobs == 5


def test_after_a_job_the_gate_rests_so_jobs_take_at_most_their_share() -> None:
    gate = BodyGate(share=0.25)

    def job() -> tuple[float, float, float]:
        start, cpu = time.monotonic(), time.thread_time()
        while time.thread_time() - cpu < 0.02:  # 20 ms of CPU (a thread's time is charged)
            pass
        return start, time.monotonic(), time.thread_time() - cpu

    async def main() -> tuple[float, list[tuple[float, float, float]]]:
        asked = time.monotonic()
        return asked, list(await asyncio.gather(gate.run(job), gate.run(job)))

    asked, ((_, _, cpu1), (start2, _, _)) = asyncio.run(main())
    # At a 25 % share, the second job starts no sooner than four times the first's CPU time
    # after both were asked for (three times after the first ended, on an idle host).
    assert start2 - asked >= 4 * cpu1


def test_past_max_waiting_the_gate_refuses_with_503() -> None:
    gate = BodyGate(share=1.0, max_waiting=2)
    release = threading.Event()

    async def main() -> None:
        first = asyncio.ensure_future(gate.run(release.wait, 5))
        second = asyncio.ensure_future(gate.run(release.wait, 5))
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as e:
            await gate.run(release.wait, 5)
        assert e.value.status == 503
        release.set()
        await asyncio.gather(first, second)

    asyncio.run(main())


def _held_jobs(started: list[str], go: asyncio.Event) -> Callable[[str], Callable[[], Awaitable[str]]]:
    """Jobs that note their start, then wait for `go`: the gate's order, without threads or time."""

    def job(name: str) -> Callable[[], Awaitable[str]]:
        async def run() -> str:
            started.append(name)
            await go.wait()
            return name

        return run

    return job


def test_another_tenants_body_gets_the_next_turn_ahead_of_a_tenants_queue() -> None:
    """One FIFO for every tenant let a tenant's flood of bodies hold every turn (an attack
    trial: another tenant's valid prompts, 2 served in 20 s instead of 127)."""
    gate = BodyGate(share=1.0, max_waiting=16)
    started: list[str] = []

    async def main() -> None:
        go = asyncio.Event()
        job = _held_jobs(started, go)
        flood = [asyncio.ensure_future(gate.admit(job(f"a{i}"), "a")) for i in range(4)]
        await asyncio.sleep(0)
        others = [asyncio.ensure_future(gate.admit(job(f"{t}1"), t)) for t in ("b", "c")]
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(*flood, *others)

    asyncio.run(main())
    assert started == ["a0", "b1", "c1", "a1", "a2", "a3"]


def test_the_gates_time_is_shared_so_a_tenant_with_slow_bodies_gets_fewer_turns() -> None:
    """Turns taken in rotation still gave most of the time to a tenant whose bodies took
    ten times as long: each job costs its tenant the time it held the gate (a clock of the
    test's, moved by the jobs themselves; times that are exact in binary)."""
    clock = [0.0]
    gate = BodyGate(share=1.0, max_waiting=16, now=lambda: clock[0])
    started: list[str] = []

    async def main() -> None:
        go = asyncio.Event()

        def job(name: str, seconds: float) -> Callable[[], Awaitable[str]]:
            async def run() -> str:
                started.append(name)
                await go.wait()
                clock[0] += seconds
                return name

            return run

        slow = [asyncio.ensure_future(gate.admit(job(f"a{i}", 1.0), "a")) for i in range(3)]
        await asyncio.sleep(0)
        quick = [asyncio.ensure_future(gate.admit(job(f"b{i}", 0.125), "b")) for i in range(12)]
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(*slow, *quick)

    asyncio.run(main())
    # a0's second buys b eight turns of 1/8 s (a tie goes to the first to wait), and so on.
    assert started == ["a0", *(f"b{i}" for i in range(8)), "a1", *(f"b{i}" for i in range(8, 12)), "a2"]


def test_a_tenant_past_its_share_of_the_queue_gets_429_and_others_still_wait() -> None:
    gate = BodyGate(share=1.0, max_waiting=16, max_waiting_per_tenant=2)
    started: list[str] = []

    async def main() -> None:
        go = asyncio.Event()
        job = _held_jobs(started, go)
        held = [asyncio.ensure_future(gate.admit(job(f"a{i}"), "a")) for i in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(ApiError) as e:
            await gate.admit(job("a2"), "a")
        assert e.value.status == 429 and e.value.code == "busy_tenant"
        assert "server.large_body_queue_per_tenant" in e.value.message
        other = asyncio.ensure_future(gate.admit(job("b0"), "b"))
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(*held, other)

    asyncio.run(main())
    assert started == ["a0", "b0", "a1"]


def test_a_body_whose_client_leaves_gives_up_its_turn_and_its_place() -> None:
    gate = BodyGate(share=1.0, max_waiting=16, max_waiting_per_tenant=1)
    started: list[str] = []

    async def main() -> None:
        go = asyncio.Event()
        job = _held_jobs(started, go)
        first = asyncio.ensure_future(gate.admit(job("a0"), "a"))
        await asyncio.sleep(0)
        leaving = asyncio.ensure_future(gate.admit(job("b0"), "b"))
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.sleep(0)
        again = asyncio.ensure_future(gate.admit(job("b1"), "b"))  # b's place is free again
        await asyncio.sleep(0)
        go.set()
        await asyncio.gather(first, again)
        assert leaving.cancelled()
        assert await gate.admit(job("c0"), "c") == "c0"  # the gate is free: at once

    asyncio.run(main())
    assert started == ["a0", "b1", "c0"]


def test_a_body_read_for_a_request_leaves_no_copy_on_it() -> None:
    """`Request.body()` keeps the bytes on the request, which the gateway holds through its
    queue and every attempt: a 1 MiB body stayed beside the copy it forwards."""
    import asyncio

    from starlette.requests import Request

    from tierserve.server.uploads import Uploads

    async def read() -> tuple[bytes | None, Request]:
        parts = [b'{"a": ', b"1}"]

        async def receive() -> dict[str, object]:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

        request = Request({"type": "http", "method": "POST", "headers": [], "path": "/"}, receive)
        return await Uploads().read(request), request

    body, request = asyncio.run(read())
    assert body == b'{"a": 1}' and "_body" not in vars(request)


class FakeClock:
    """The gate's clock for a test: moved by its jobs and by `asyncio.sleep` (patched to
    move it rather than wait), so a run of minutes takes milliseconds and never varies."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.t = 0.0
        self._yield = asyncio.sleep  # the real one: a turn of the loop
        monkeypatch.setattr(asyncio, "sleep", self.sleep)
        self.jobs: list[tuple[str, float, float]] = []  # tenant, start, end

    def now(self) -> float:
        return self.t

    async def turn(self) -> None:
        await self._yield(0)

    async def sleep(self, seconds: float) -> None:
        self.t += max(seconds, 0.0)
        await self._yield(0)

    def job(self, tenant: str, seconds: float) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            start = self.t
            self.t += seconds
            await self._yield(0)
            self.jobs.append((tenant, start, self.t))

        return run

    async def loop(self, gate: BodyGate, tenant: str, seconds: float, until: float) -> None:
        """A client of `tenant`: its next body as soon as the last one is answered."""
        while self.t < until:
            await gate.admit(self.job(tenant, seconds), tenant)

    def count(self, tenant: str) -> int:
        return sum(1 for t, _, _ in self.jobs if t == tenant)


def _run(*clients: Awaitable[None]) -> None:
    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*clients), timeout=60)

    asyncio.run(main())


def test_a_cheap_tenant_is_not_held_behind_a_costly_tenants_rests(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant flooding the gate with slow bodies (10 ms, four at a time) beside one that
    sends 1 ms bodies one after another: each gets about its half of the 10 % share. The
    rest after each job was the gate's, so the flood took the gate whenever the other had
    no body waiting and everyone waited out its 90 ms rest: 91 of the other's bodies
    instead of ~500 (a live trial: 6 of 68 in 8 s)."""
    clock = FakeClock(monkeypatch)
    gate = BodyGate(share=0.1, max_waiting=16, now=clock.now)
    until = 10.0
    _run(*(clock.loop(gate, "flood", 0.010, until) for _ in range(4)), clock.loop(gate, "b", 0.001, until))
    # Alone, each would get 10 s * 10 % of its job time: 100 slow bodies, 1000 quick ones.
    assert clock.count("b") >= 0.4 * 1000
    assert clock.count("flood") >= 0.4 * 100


def test_the_jobs_take_at_most_the_share_over_a_run_whatever_the_tenants(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every tenant's budget lets it start a job, each its own: 300 one-off tenants arriving
    at once, beside a flood and a steady client, still get no more than the gate's share
    of the time, past one burst."""
    clock = FakeClock(monkeypatch)
    share = 0.1
    gate = BodyGate(share=share, max_waiting=400, now=clock.now)
    until = 30.0

    async def one_offs() -> None:
        while clock.t < 5.0:  # the others' jobs move the clock
            await clock.turn()
        await asyncio.gather(*(gate.admit(clock.job(f"once{i}", 0.004), f"once{i}") for i in range(300)))

    _run(
        *(clock.loop(gate, "flood", 0.020, until) for _ in range(4)),
        clock.loop(gate, "b", 0.002, until),
        one_offs(),
    )
    spans = sorted((start, end) for _, start, end in clock.jobs)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # one at a time
    done = 0.0
    for start, end in spans:  # at every job's end, since the start
        done += end - start
        assert done <= share * end + body_gate.BURST_S + 0.020
    assert clock.count("once299") == 1 and clock.t >= until
    assert done >= 0.9 * share * clock.t  # and the gate is not left idle


def test_a_job_is_charged_the_cpu_time_it_reports_not_its_wait_for_a_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a busy host a parse in the niced parser process took 3x its CPU time (valid 200 KB
    bodies: 10 ms median beside a flood, 3 ms alone), and its tenant paid for the wait: a
    job that reports its CPU time is charged that, its wall time being the cap."""
    clock = FakeClock(monkeypatch)
    gate = BodyGate(share=0.1, max_waiting=16, now=clock.now)

    async def busy_host_parse() -> None:
        clock.t += 0.030  # 30 ms on the clock, 3 ms of them on a CPU
        body_gate.report_cpu(0.003)
        await clock.turn()
        clock.jobs.append(("b", 0.0, clock.t))

    async def main() -> None:
        while clock.t < 10.0:
            await gate.admit(busy_host_parse, "b")

    _run(main())
    # Charged 3 ms, each is followed by 27 ms of rest at 10 %: ~300 in 10 s, not ~33.
    assert clock.count("b") >= 250


def test_a_thread_job_reports_its_own_cpu_time() -> None:
    gate = BodyGate(share=1.0)
    charged: list[float] = []
    monkey = gate._charge

    def spy(tenant: str, spent: float) -> None:
        charged.append(spent)
        monkey(tenant, spent)

    gate._charge = spy  # type: ignore[method-assign]
    asyncio.run(gate.run(time.sleep, 0.05))  # 50 ms asleep, next to no CPU
    assert charged and charged[0] < 0.02


def test_a_tenants_thread_job_is_charged_to_it_at_its_own_cpu_time() -> None:
    """A large prompt's preparation went through the gate charged its wall time, paying for
    a busy host's wait for a CPU as the parses had."""
    gate = BodyGate(share=1.0)
    charged: list[tuple[str, float]] = []
    monkey = gate._charge

    def spy(tenant: str, spent: float) -> None:
        charged.append((tenant, spent))
        monkey(tenant, spent)

    gate._charge = spy  # type: ignore[method-assign]
    assert asyncio.run(gate.run_for("acme", _asleep_then, 0.05, "prepared")) == "prepared"
    (tenant, spent), *_ = charged
    assert tenant == "acme" and spent < 0.02  # 50 ms asleep, next to no CPU


def _asleep_then(seconds: float, result: str) -> str:
    time.sleep(seconds)
    return result
