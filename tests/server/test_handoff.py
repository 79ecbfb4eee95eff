"""The engine process waits, after a step's first tokens, until the server has sent them on
(handoff.py): the wait itself, and the engine's step loop around it."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Connection

import pytest

from tests.server.helpers import text_backend
from tierserve.clock import WallClock
from tierserve.request import Request, SamplingParams
from tierserve.server import handoff
from tierserve.server.config import ServeConfig
from tierserve.server.engine_core import EngineCore
from tierserve.server.engine_messages import (
    AddRequest,
    EngineReady,
    EngineRecipe,
    FirstsHandled,
    Shutdown,
    StepOutputs,
)
from tierserve.server.handoff import HANDOFF_WAIT_MAX_S, Handoff, handoff_timeout_s
from tierserve.tiers import ALL_TIERS, Tier


def test_the_bound_grows_with_the_first_tokens_and_is_capped() -> None:
    assert handoff_timeout_s(1) < handoff_timeout_s(10) <= HANDOFF_WAIT_MAX_S
    assert handoff_timeout_s(10_000) == HANDOFF_WAIT_MAX_S


def test_a_wait_ends_as_soon_as_the_server_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handoff, "HANDOFF_WAIT_MAX_S", 60.0)
    monkeypatch.setattr(handoff, "HANDOFF_WAIT_S", 60.0)
    h = Handoff()
    threading.Timer(0.05, h.handled, args=(2.0,)).start()
    assert h.wait(2.0, 1)  # True: answered, long before the (patched) bound


def test_an_answer_for_an_earlier_step_does_not_end_the_wait_for_a_later_one() -> None:
    h = Handoff()
    h.handled(1.0)
    assert not h.wait(2.0, 1)  # timed out: step 2's first tokens were never handled
    h.handled(2.0)
    assert h.wait(2.0, 1) and h.wait(1.5, 1)  # later answers cover earlier steps
    h.handled(1.0)  # a late, older answer changes nothing
    assert h.wait(2.0, 1)


def _recipe() -> EngineRecipe:
    config = ServeConfig().engine
    targets = {t: config.tiers[t].ttft_target_s for t in ALL_TIERS}
    return EngineRecipe(config, "hybrid", partial(text_backend), targets, WallClock().origin)


def test_the_engine_sends_the_rest_of_a_step_only_once_its_first_tokens_are_handled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step loop in this process, its pipe to a stand-in server (this test)."""
    monkeypatch.setattr(handoff, "HANDOFF_WAIT_MAX_S", 60.0)  # the wait ends only with the answer
    monkeypatch.setattr(handoff, "HANDOFF_WAIT_S", 60.0)
    server, engine_end = multiprocessing.get_context("spawn").Pipe(duplex=True)
    core = EngineCore.build(_recipe(), engine_end)
    assert isinstance(server.recv(), EngineReady)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    try:
        req = Request("a", [1, 2, 3], SamplingParams(max_tokens=8), tier=Tier.P0, arrival_time=0.0)
        server.send([AddRequest(req, Tier.P0)])
        firsts = _next_step_outputs(server, lambda m: bool(m.firsts))
        assert [rid for rid, _ in firsts.firsts] == ["a"]
        assert not server.poll(0.3)  # the engine waits: nothing more of this step comes
        server.send([FirstsHandled(firsts.returned_at)])
        rest = _next_step_outputs(server, lambda m: m.snapshot is not None)
        assert rest.returned_at == firsts.returned_at and not rest.firsts  # the same step's rest
    finally:
        server.send([Shutdown()])
        loop.join(10)
    assert not loop.is_alive()


def _next_step_outputs(conn: Connection, wanted: Callable[[StepOutputs], bool]) -> StepOutputs:
    while conn.poll(10):
        message = conn.recv()
        if isinstance(message, StepOutputs) and wanted(message):
            return message
    raise AssertionError("the engine sent no such StepOutputs within 10 s")


def test_requests_taken_in_between_steps_are_not_reported_as_waiting_before_a_pass_sees_them() -> None:
    """The state the server exports is the one the last step left (vLLM counts waiting after
    its scheduling pass): a new request waits only for the step boundary, and a gateway that
    read it as a queue held streams back from an idle replica."""
    server, engine_end = multiprocessing.get_context("spawn").Pipe(duplex=True)
    core = EngineCore.build(_recipe(), engine_end)
    assert isinstance(server.recv(), EngineReady)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=8), tier=Tier.P1, arrival_time=0.0)
    core._inbox.append(AddRequest(req, Tier.P1))
    core._apply_inbox()
    message = server.recv()
    assert isinstance(message, StepOutputs) and message.accepted == ["a"]
    assert core.engine.num_waiting(Tier.P1) == 1  # in the engine's queue until the next pass
    assert message.snapshot is None and message.applied is None  # admission counts it as sent
