"""The engine thread and the event loop: ordering, coalescing, inspection, failure isolation."""

from __future__ import annotations

import asyncio

from tests.server.helpers import REPLY, ByteTokenizer, make_state
from tierserve.request import FinishReason, Request, SamplingParams
from tierserve.server.streams import DISPATCH_SLICE, Delta, RequestHandle
from tierserve.tiers import Tier


async def _collect(handle: RequestHandle) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    while True:
        for delta in await handle.next():
            tokens.extend(delta.token_ids)
            if delta.finished:
                return tokens, delta.finish_reason


def test_every_stream_gets_its_tokens_in_order_when_delivery_is_sliced() -> None:
    state = make_state(step_s=0.0005)
    engine = state.engine
    n = DISPATCH_SLICE * 6

    async def run() -> list[tuple[list[int], FinishReason | None]]:
        engine.start()
        try:
            handles = []
            for i in range(n):
                req = Request(
                    f"r{i}",
                    ByteTokenizer().encode(f"prompt {i}"),
                    SamplingParams(max_tokens=40),
                    tier=Tier(i % 4),
                    arrival_time=state.clock.now(),
                )
                handles.append(engine.submit(req, Tier.P0))
            results = await asyncio.gather(*(_collect(h) for h in handles))
            for h in handles:
                engine.close(h)
            return results
        finally:
            await engine.stop()

    expected = list(REPLY.encode()[:40])
    for tokens, reason in asyncio.run(run()):
        assert tokens == expected and reason is FinishReason.LENGTH


def test_inspect_runs_on_the_engine_thread_and_propagates_errors() -> None:
    state = make_state()

    async def run() -> tuple[int, str]:
        state.engine.start()
        try:
            total = await state.engine.inspect(lambda e: e.memory.num_blocks)
            try:
                await state.engine.inspect(lambda e: 1 / 0)
            except ZeroDivisionError as err:
                return total, type(err).__name__
            return total, ""
        finally:
            await state.engine.stop()

    assert asyncio.run(run()) == (1024, "ZeroDivisionError")


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on() -> None:
    state = make_state()
    engine = state.engine.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step() -> list:  # type: ignore[type-arg]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real_step()

    engine.step = flaky_step  # type: ignore[method-assign]

    async def run() -> tuple[Delta, tuple[list[int], FinishReason | None]]:
        state.engine.start()
        try:
            first = state.engine.submit(
                Request("a", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=state.clock.now()), Tier.P0
            )
            failed = (await first.next())[-1]
            second = state.engine.submit(
                Request("b", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=state.clock.now()), Tier.P0
            )
            return failed, await _collect(second)
        finally:
            await state.engine.stop()

    failed, (tokens, reason) = asyncio.run(run())
    assert failed.finished and failed.error == "internal engine error"
    assert len(tokens) == 4 and reason is FinishReason.LENGTH
    assert state.engine.num_step_errors == 1


def test_a_request_the_engine_refuses_ends_with_its_reason() -> None:
    state = make_state(max_model_len=64)

    async def run() -> Delta:
        state.engine.start()
        try:
            req = Request("big", [1] * 60, SamplingParams(max_tokens=10), arrival_time=state.clock.now())
            return (await state.engine.submit(req, Tier.P0).next())[-1]
        finally:
            await state.engine.stop()

    end = asyncio.run(run())
    assert end.finished and end.finish_reason is FinishReason.REJECTED and "context" in end.error
    assert 'reason="engine_refused"' in state.metrics.render().decode()
