"""The engine process and the event loop: ordering, coalescing, inspection, failure isolation."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection

import pytest
import uvloop

from tests.server.helpers import REPLY, ByteTokenizer, make_state
from tierserve.engine import Engine
from tierserve.request import FinishReason, Request, SamplingParams
from tierserve.server.admission import ThroughputMeter
from tierserve.server.engine_client import EngineClient
from tierserve.server.engine_messages import EngineReady, FirstsHandled, StepOutputs
from tierserve.server.streams import ACCEPTED, DISPATCH_SLICE, Delta, RequestHandle
from tierserve.tiers import Tier


async def _collect(handle: RequestHandle) -> tuple[list[int], FinishReason | None]:
    tokens: list[int] = []
    while True:
        for delta in await handle.next():
            tokens.extend(delta.token_ids)
            if delta.finished:
                return tokens, delta.finish_reason


async def _end(handle: RequestHandle) -> Delta:
    while True:
        for delta in await handle.next():
            if delta.finished:
                return delta


def _client(**kw: object) -> EngineClient:
    engine = make_state(**kw).engine
    assert isinstance(engine, EngineClient)
    return engine


def test_a_handler_hears_that_the_engine_accepted_its_request_before_any_token() -> None:
    """So that a stream's status line is sent while the engine prefills, not with the token."""
    gate = multiprocessing.get_context("spawn").Event()
    state = make_state(gate=gate)  # the executor's first step waits for the gate
    engine = state.engine

    async def run() -> tuple[list[Delta], list[int]]:
        engine.start()
        try:
            handle = engine.submit(
                Request("a", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=state.clock.now()), Tier.P0
            )
            before = await asyncio.wait_for(handle.next(), 30)  # no step has returned yet
            gate.set()
            tokens, _ = await _collect(handle)
            return before, tokens
        finally:
            gate.set()
            await engine.stop()

    before, tokens = asyncio.run(run())
    assert before == [ACCEPTED] and not ACCEPTED.token_ids and not ACCEPTED.finished
    assert len(tokens) == 4


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


def _num_blocks(engine: Engine) -> int:
    return engine.memory.num_blocks


def _divide_by_zero(engine: Engine) -> float:
    return 1 / 0


def test_inspect_runs_in_the_engine_process_and_propagates_errors() -> None:
    engine = _client()

    async def run() -> tuple[int, str]:
        engine.start()
        try:
            total = await engine.inspect(_num_blocks)
            try:
                await engine.inspect(_divide_by_zero)
            except ZeroDivisionError as err:
                return total, type(err).__name__
            return total, ""
        finally:
            await engine.stop()

    assert asyncio.run(run()) == (1024, "ZeroDivisionError")


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on() -> None:
    state = make_state(fail_steps=(1,))  # the executor raises in its first step
    engine = state.engine

    async def run() -> tuple[Delta, tuple[list[int], FinishReason | None], str]:
        engine.start()
        try:
            first = engine.submit(
                Request("a", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=state.clock.now()), Tier.P0
            )
            failed = await _end(first)
            second = engine.submit(
                Request("b", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=state.clock.now()), Tier.P0
            )
            collected = await _collect(second)
            return failed, collected, state.metrics.render(await engine.metric_families()).decode()
        finally:
            await engine.stop()

    failed, (tokens, reason), metrics = asyncio.run(run())
    assert failed.finished and failed.error == "internal engine error"
    assert len(tokens) == 4 and reason is FinishReason.LENGTH
    assert engine.num_step_errors == 1
    # The failed request is counted among the ended ones, as aborted.
    ended = [line for line in metrics.splitlines() if line.startswith("tierserve_requests_total{")]
    assert any('finish_reason="abort"' in line and line.endswith(" 1.0") for line in ended), ended


def test_a_request_the_engine_refuses_ends_with_its_reason() -> None:
    state = make_state(max_model_len=64)
    engine = state.engine

    async def run() -> tuple[Delta, bytes]:
        engine.start()
        try:
            req = Request("big", [1] * 60, SamplingParams(max_tokens=10), arrival_time=state.clock.now())
            end = await _end(engine.submit(req, Tier.P0))
            return end, state.metrics.render(await engine.metric_families())
        finally:
            await engine.stop()

    end, metrics = asyncio.run(run())
    assert end.finished and end.finish_reason is FinishReason.REJECTED and "context" in end.error
    assert 'reason="engine_refused"' in metrics.decode()


def _handle(i: int, tier: Tier = Tier.P2) -> RequestHandle:
    return RequestHandle(
        Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4), tier=tier, arrival_time=0.0)
    )


def _record_wake_order(handles: list[RequestHandle]) -> tuple[list[str], list[asyncio.Future[None]]]:
    """Tasks that each wait for a handle's first delivery; the ids, in the order they woke."""
    order: list[str] = []

    async def wait(h: RequestHandle) -> None:
        await h.next()
        order.append(h.request.request_id)

    return order, [asyncio.ensure_future(wait(h)) for h in handles]


def test_first_tokens_go_ahead_of_queued_deltas_and_signal_when_handled() -> None:
    import threading

    from tierserve.server.streams import Dispatcher

    async def run() -> tuple[list[str], bool, bool]:
        done = threading.Event()
        dispatcher = Dispatcher(asyncio.get_running_loop(), done)
        busy = [_handle(i) for i in range(DISPATCH_SLICE * 3)]
        new = [_handle(100), _handle(101, Tier.P0), _handle(102)]
        order, tasks = _record_wake_order(busy + new)
        await asyncio.sleep(0)
        done.clear()
        dispatcher.post([(h, Delta((7,))) for h in busy])  # a step's tokens, not first ones
        set_without_firsts = done.is_set()
        done.clear()
        # The next step's first tokens arrive while most of that burst is still queued.
        dispatcher.post([], [(h, Delta((8,))) for h in new[:2]])
        dispatcher.post([], [(new[2], Delta((8,)))])  # a later step's: behind the earlier ones
        dispatcher.post([(busy[0], Delta((9,)))])  # more queued deltas: no first tokens in them
        pending_while_queued = done.is_set()
        while not done.is_set():
            await asyncio.sleep(0)
        handled_when_set = {"r100", "r101", "r102"} <= set(order)
        await asyncio.gather(*tasks)
        return order, set_without_firsts, pending_while_queued or not handled_when_set

    order, set_without_firsts, early = asyncio.run(run())
    # The first slice of the burst was woken at once; the first tokens overtook the rest.
    assert order.index("r100") < order.index(f"r{DISPATCH_SLICE}")
    assert order.index("r101") < order.index("r102") < order.index(f"r{DISPATCH_SLICE}")
    assert set_without_firsts  # nothing urgent: the engine need not wait
    assert not early  # set only once the first tokens' handlers had run


def test_first_tokens_are_posted_before_the_rest_of_the_step() -> None:
    """One step gives some requests their first token and others a later one: the first
    tokens are handed to the event loop in a post of their own, ahead of the rest."""
    state = make_state(step_s=0.0005)
    engine = state.engine
    posts: list[tuple[list[str], list[str]]] = []

    async def run() -> None:
        engine.start()
        assert engine._dispatcher is not None
        dispatcher = engine._dispatcher
        original = dispatcher.post

        def spy(items: list[tuple[RequestHandle, Delta]], firsts: tuple = ()) -> None:  # type: ignore[type-arg]
            posts.append(
                ([h.request.request_id for h, _ in items], [h.request.request_id for h, _ in firsts])
            )
            original(items, firsts)

        dispatcher.post = spy  # type: ignore[method-assign]
        try:
            tok = ByteTokenizer()
            early = engine.submit(
                Request(
                    "early", tok.encode("a"), SamplingParams(max_tokens=30), arrival_time=state.clock.now()
                ),
                Tier.P0,
            )
            await early.next()
            late = engine.submit(
                Request(
                    "late", tok.encode("b"), SamplingParams(max_tokens=3), arrival_time=state.clock.now()
                ),
                Tier.P0,
            )
            await asyncio.gather(_collect(early), _collect(late))
            engine.close(early)
            engine.close(late)
        finally:
            await engine.stop()

    asyncio.run(run())
    i = next(i for i, (_, firsts) in enumerate(posts) if "late" in firsts)
    items, firsts = posts[i]
    assert firsts == ["late"] and items == []  # the first token alone, at once
    assert "early" in posts[i + 1][0]  # the same step's other token, in the next post


def test_freeze_heap_moves_start_up_objects_out_of_the_collector() -> None:
    import gc

    from tests.server.helpers import live_server

    gc.unfreeze()
    try:
        with live_server(make_state(), freeze_heap=True):
            frozen = gc.get_freeze_count()
        assert frozen > 1000
    finally:
        gc.unfreeze()
    with live_server(make_state()):
        assert gc.get_freeze_count() == 0


def test_more_first_tokens_than_are_woken_at_once_all_go_ahead_of_queued_deltas() -> None:
    import threading

    from tierserve.server.streams import FIRSTS_AT_ONCE, Dispatcher

    async def run() -> tuple[list[str], bool]:
        done = threading.Event()
        dispatcher = Dispatcher(asyncio.get_running_loop(), done)
        busy = [_handle(i) for i in range(DISPATCH_SLICE * 3)]
        new = [_handle(1000 + i) for i in range(FIRSTS_AT_ONCE + 3)]
        order, tasks = _record_wake_order(busy + new)
        await asyncio.sleep(0)
        dispatcher.post([(h, Delta((7,))) for h in busy])
        done.clear()
        dispatcher.post([], [(h, Delta((8,))) for h in new])
        while not done.is_set():
            await asyncio.sleep(0)
        handled_when_set = {h.request.request_id for h in new} <= set(order)
        await asyncio.gather(*tasks)
        return order, handled_when_set

    order, handled_when_set = asyncio.run(run())
    firsts = [rid for rid in order if int(rid[1:]) >= 1000]
    assert firsts == [f"r{1000 + i}" for i in range(FIRSTS_AT_ONCE + 3)]  # in the order posted
    # Only the burst's first slice (woken before the first tokens came) runs ahead of them.
    assert all(order.index(rid) < order.index(f"r{DISPATCH_SLICE}") for rid in firsts)
    assert handled_when_set


def _client_over_a_pipe() -> tuple[EngineClient, Connection]:
    """An `EngineClient` whose engine process is this test, at the other end of a pipe."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=True)
    ready = EngineReady(0, "stand-in", 512, 4096, 16, dict.fromkeys(Tier, 64), ByteTokenizer())
    return EngineClient(ctx.Process(), ours, ready, ThroughputMeter()), theirs


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_first_tokens_are_handled_and_answered_before_the_rest_of_the_step_is_read(
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """The engine writes a step's first tokens and, right behind them, the step's other tokens:
    the first tokens' handlers run, then `FirstsHandled` goes back, then the rest is read."""
    client, engine_end = _client_over_a_pipe()
    events: list[str] = []
    apply, answer = client._apply, client._firsts_handled

    def spy_apply(out: StepOutputs) -> None:
        events.append("firsts read" if out.firsts else "rest read")
        apply(out)

    def spy_answer(returned_at: float) -> None:
        events.append("answered")
        answer(returned_at)

    client._apply = spy_apply  # type: ignore[method-assign]
    client._firsts_handled = spy_answer  # type: ignore[method-assign]

    async def handler(handle: RequestHandle) -> None:
        await handle.next()
        events.append(f"{handle.request.request_id} handled")

    async def run() -> None:
        client.start()
        old, new = _handle(0), _handle(1)
        for h in (old, new):
            client._handles[h.request.request_id] = client._routes[h.request.request_id] = h
        client._started.add("r0")  # r0 has had its first token already
        tasks = [asyncio.ensure_future(handler(h)) for h in (old, new)]
        await asyncio.sleep(0)
        engine_end.send(StepOutputs(firsts=[("r1", Delta((5,)))], returned_at=2.0, returned=2.0))
        engine_end.send(StepOutputs(tokens=[("r0", (6,))], returned_at=2.0, returned=2.0))
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(run())
    assert events == ["firsts read", "r1 handled", "answered", "rest read", "r0 handled"]
    commands = engine_end.recv()
    assert commands == [FirstsHandled(2.0)]
