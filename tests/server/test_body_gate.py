"""The gate that parses large bodies: off the event loop, one at a time, within its share."""

from __future__ import annotations

import asyncio
import threading
import time

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
