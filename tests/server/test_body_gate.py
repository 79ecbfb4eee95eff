"""The gate that parses large bodies: off the event loop, one at a time, within its share."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

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

    def job() -> tuple[float, float]:
        start = time.monotonic()
        time.sleep(0.02)
        return start, time.monotonic()

    async def main() -> list[tuple[float, float]]:
        return list(await asyncio.gather(gate.run(job), gate.run(job)))

    (start1, end1), (start2, _) = asyncio.run(main())
    # At a 25 % share, a job is followed by a rest of at least three times its duration.
    assert start2 >= end1 + 3 * (end1 - start1)


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
