from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from tierserve.bench.driver import NEVER_STARTED, RUN_ENDED, DriverConfig, DriverResult, run_workload
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, SchedulerConfig
from tierserve.engine import Engine
from tierserve.executors.null import NullExecutor
from tierserve.executors.sim.executor import build_sim_executor
from tierserve.request import EventKind, Request, RequestStatus
from tierserve.tiers import Tier
from tierserve.workloads.spec import RequestSpec
from tierserve.workloads.synthetic import synthetic_stream


def make_engine(policy: str = "hybrid", max_model_len: int = 8192) -> tuple[Engine, VirtualClock]:
    clock = VirtualClock()
    executor = NullExecutor(num_device_blocks=4096, num_host_blocks=4096, max_model_len=max_model_len)
    executor.record = False
    return Engine(EngineConfig(), policy, executor, clock), clock


def spec(
    index: int,
    num_prompt: int = 32,
    max_tokens: int = 4,
    tier: Tier = Tier.P1,
    arrival_s: float | None = None,
) -> RequestSpec:
    prompt = tuple(range(100 + index, 100 + index + num_prompt))
    return RequestSpec(index, tier, "t", prompt, max_tokens, arrival_s=arrival_s)


def small_stream(n: int) -> Iterator[RequestSpec]:
    """Synthetic traffic with short outputs, so runs stay small."""
    for s in itertools.islice(synthetic_stream(1, 2048), n):
        yield RequestSpec(s.index, s.tier, s.tenant, s.prompt_token_ids[:200], min(s.max_tokens, 12))


def test_closed_loop_keeps_exactly_n_in_flight() -> None:
    engine, clock = make_engine()
    exhausted = False

    def specs() -> Iterator[RequestSpec]:
        nonlocal exhausted
        yield from small_stream(120)
        exhausted = True

    in_flight: list[int] = []
    step = engine.step

    def counting_step() -> list:  # type: ignore[type-arg]
        if not exhausted:
            in_flight.append(engine.num_waiting() + engine.num_running() + engine.num_swapped())
        return step()

    engine.step = counting_step  # type: ignore[method-assign]
    run_workload(engine, clock, specs(), DriverConfig(num_measured=200, concurrency=6))
    assert len(in_flight) > 20 and set(in_flight) == {6}


def test_every_submitted_request_is_accounted_for_even_when_the_run_is_cut_short() -> None:
    engine, clock = make_engine()
    specs = [spec(i, max_tokens=2000 if i % 3 == 0 else 3) for i in range(40)]
    result = run_workload(
        engine, clock, specs, DriverConfig(num_measured=30, num_warmup=5, concurrency=8, drain_timeout_s=2.0)
    )
    statuses = {r.status for r in result.records}
    assert len(result.records) == 40 and statuses == {RequestStatus.FINISHED, RequestStatus.ABORTED}
    assert not engine.has_unfinished()
    assert sorted(r.index for r in result.records if r.measured) == list(range(5, 35))
    assert result.end_s < 2.0 + max(r.arrival_s for r in result.records) + 1.0


def test_a_request_cut_by_the_runs_end_says_whether_it_had_started() -> None:
    """A request still waiting for its first token when the run ends is starved, not a long
    answer in progress: the P3 target tells the two apart by this reason."""
    clock = VirtualClock()
    executor = NullExecutor(num_device_blocks=4096, num_host_blocks=4096, max_model_len=8192)
    executor.record = False
    engine = Engine(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=2)), "fcfs", executor, clock)
    specs = [spec(i, max_tokens=2000) for i in range(12)]
    result = run_workload(
        engine, clock, specs, DriverConfig(num_measured=10, num_warmup=0, concurrency=8, drain_timeout_s=0.5)
    )
    cut = [r for r in result.records if r.status is RequestStatus.ABORTED]
    assert {r.end_reason for r in cut} == {RUN_ENDED, NEVER_STARTED}
    assert all((r.end_reason == RUN_ENDED) == (r.first_token_s is not None) for r in cut)


def test_rejected_requests_are_recorded_and_the_client_moves_on() -> None:
    engine, clock = make_engine(max_model_len=256)
    specs = [spec(0), spec(1, num_prompt=300), spec(2)]
    result = run_workload(engine, clock, specs, DriverConfig(num_measured=3, concurrency=1))
    assert sorted(r.index for r in result.records) == [0, 1, 2]
    assert [r.index for r in result.records if r.status is RequestStatus.REJECTED] == [1]


def test_open_loop_submits_at_arrival_times_and_jumps_idle_gaps() -> None:
    engine, clock = make_engine()
    submitted: list[Request] = []
    add = engine.add_request

    def capture(req: Request) -> bool:
        submitted.append(req)
        return add(req)

    engine.add_request = capture  # type: ignore[method-assign]
    specs = [spec(0, arrival_s=0.0), spec(1, arrival_s=0.005), spec(2, arrival_s=100.0)]
    result = run_workload(engine, clock, specs, DriverConfig(num_measured=3, concurrency=None))
    assert [r.arrival_time for r in submitted] == [0.0, 0.005, 100.0]
    arrived = [next(e.time for e in r.events if e.kind is EventKind.ARRIVED) for r in submitted]
    assert arrived[0] == 0.0 and arrived[1] >= 0.005 and arrived[2] == 100.0  # idle until 100 s
    assert all(r.status is RequestStatus.FINISHED for r in result.records)


def test_a_conversation_turn_carries_the_previous_real_answer() -> None:
    engine, clock = make_engine()
    prompts: list[list[int]] = []
    add = engine.add_request
    engine.add_request = lambda req: prompts.append(list(req.prompt_token_ids)) or add(req)  # type: ignore
    first = RequestSpec(0, Tier.P0, "c", (1, 2, 3), 2, conversation_id="c")
    second = RequestSpec(
        1, Tier.P0, "c", (1, 2, 3, 900, 901, 50), 2, conversation_id="c", num_history_tokens=5
    )
    run_workload(engine, clock, [first, second], DriverConfig(num_measured=2, concurrency=1))
    assert prompts[1] == [1, 2, 3, 7, 7, 50]  # NullExecutor answers with token 7


@pytest.mark.parametrize("open_loop", [False, True])
def test_a_turn_waits_for_its_conversations_previous_answer_and_others_go_first(open_loop: bool) -> None:
    engine, clock = make_engine()
    prompts: dict[str, list[int]] = {}
    add = engine.add_request
    engine.add_request = lambda req: (  # type: ignore
        prompts.__setitem__(req.request_id, list(req.prompt_token_ids)) or add(req)
    )
    at = 0.0 if open_loop else None
    first = RequestSpec(0, Tier.P0, "c", (1, 2, 3), 20, conversation_id="c", arrival_s=at)
    second = RequestSpec(
        1,
        Tier.P0,
        "c",
        (1, 2, 3, *[900] * 20, 50),
        2,
        conversation_id="c",
        num_history_tokens=23,
        arrival_s=at,
    )
    other = RequestSpec(2, Tier.P1, "t", (5, 6, 7), 2, arrival_s=at)
    config = DriverConfig(num_measured=3, concurrency=None if open_loop else 4)
    result = run_workload(engine, clock, [first, second, other], config)
    by_index = {r.index: r for r in result.records}
    assert by_index[1].arrival_s >= by_index[0].finish_s, "the next turn is sent after the answer"
    if open_loop:  # the workload's own time is kept beside the real one (goodput's span)
        assert by_index[1].scheduled_s == 0.0 < by_index[1].arrival_s
    else:
        assert all(r.scheduled_s is None for r in result.records)
    assert by_index[2].arrival_s < by_index[0].finish_s, "a free client sends the next request meanwhile"
    assert prompts["r1"] == [1, 2, 3, *[7] * 20, 50]  # the real answer: the history is all cached
    assert by_index[1].num_cached_tokens > 0
    assert all(r.status is RequestStatus.FINISHED for r in result.records)


def test_turns_of_one_conversation_run_one_after_another_even_with_free_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tierserve.bench.driver as driver

    monkeypatch.setattr(driver, "MAX_HELD", 3)  # the clients wait once 3 turns are held
    engine, clock = make_engine()
    turns = [RequestSpec(i, Tier.P0, "c", (1, 2, 3, i), 3, conversation_id="c") for i in range(12)]
    result = run_workload(engine, clock, turns, DriverConfig(num_measured=12, concurrency=4))
    records = sorted(result.records, key=lambda r: r.arrival_s)
    assert [r.index for r in records] == list(range(12))
    assert all(b.arrival_s >= a.finish_s for a, b in itertools.pairwise(records))
    assert all(r.status is RequestStatus.FINISHED for r in records)


def _slow_conversation_then_others(open_loop: bool) -> list[RequestSpec]:
    """Four turns of one slow conversation (the later ones held), then quick requests."""
    at = 0.0 if open_loop else None
    slow = [
        RequestSpec(i, Tier.P0, "c", (1, 2, 3, i), 40, conversation_id="c", arrival_s=at) for i in range(4)
    ]
    return [*slow, *(spec(i, max_tokens=2, arrival_s=at) for i in range(4, 80))]


@pytest.mark.parametrize("open_loop", [False, True])
def test_traffic_flows_on_past_the_cap_while_a_measured_turn_is_held(open_loop: bool) -> None:
    """The cap on submissions (the cool-down's length) is reached while the slow
    conversation's measured turns are still held: they are sent, and the traffic flows on
    meanwhile (bounded by the hard cap), as the others met it."""
    import tierserve.bench.driver as driver

    engine, clock = make_engine()
    config = DriverConfig(num_measured=10, concurrency=None if open_loop else 8, max_requests=12)
    result = run_workload(engine, clock, _slow_conversation_then_others(open_loop), config)
    assert sorted(r.index for r in result.records if r.measured) == list(range(10))
    assert all(r.status is RequestStatus.FINISHED for r in result.records)
    # Past the cap of 12 while turns were held, up to the hard cap (4 x 12), not the stream.
    assert 12 + 4 < len(result.records) <= driver.HARD_CAP_FACTOR * 12 + 4 < 80


@pytest.mark.parametrize("open_loop", [False, True])
def test_past_the_hard_cap_only_measured_turns_are_still_sent(
    open_loop: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tierserve.bench.driver as driver

    monkeypatch.setattr(driver, "HARD_CAP_FACTOR", 1)
    engine, clock = make_engine()
    config = DriverConfig(num_measured=10, concurrency=None if open_loop else 8, max_requests=12)
    result = run_workload(engine, clock, _slow_conversation_then_others(open_loop), config)
    assert sorted(r.index for r in result.records if r.measured) == list(range(10))
    assert max(r.index for r in result.records) < 12 + 4  # the traffic stopped at the cap


def test_window_covers_the_measured_requests_only() -> None:
    engine, clock = make_engine()
    result = run_workload(
        engine, clock, small_stream(60), DriverConfig(num_measured=30, num_warmup=10, concurrency=4)
    )
    measured = [r for r in result.records if r.measured]
    assert {r.index for r in measured} == set(range(10, 40))
    assert result.window.start_s == min(r.arrival_s for r in measured)
    assert result.window.end_s == max(r.finish_s for r in measured)
    assert 0 < result.window.num_generated_tokens < result.stats.num_generated_tokens


def run_twice() -> tuple[DriverResult, DriverResult]:
    out = []
    for _ in range(2):
        engine, clock = make_engine()
        out.append(
            run_workload(engine, clock, small_stream(80), DriverConfig(num_measured=50, concurrency=8))
        )
    return out[0], out[1]


def test_same_workload_same_records() -> None:
    a, b = run_twice()
    assert a.records == b.records and a.window == b.window


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError):
        DriverConfig(num_measured=0)


def slow_engine(step_s: float = 1.0) -> tuple[Engine, VirtualClock]:
    clock = VirtualClock()
    executor = NullExecutor(num_device_blocks=4096, num_host_blocks=4096, step_s=step_s, per_token_s=0.0)
    executor.record = False
    return Engine(EngineConfig(), "fcfs", executor, clock), clock


def test_a_request_arriving_mid_step_waits_for_the_step_in_flight_and_counts_from_its_arrival() -> None:
    engine, clock = slow_engine(step_s=1.0)
    # A long request makes steps of 1 s from t = 0; the second arrives at 0.25 s, mid-step.
    specs = [spec(0, max_tokens=10, arrival_s=0.0), spec(1, max_tokens=2, arrival_s=0.25)]
    result = run_workload(engine, clock, specs, DriverConfig(num_measured=2, concurrency=None))
    late = next(r for r in result.records if r.index == 1)
    assert late.arrival_s == 0.25  # its own instant, not the step boundary at 1.0
    assert late.first_token_s is not None
    # It waits 0.75 s for the step in flight, then its own 1 s step.
    assert late.first_token_s - late.arrival_s == pytest.approx(1.75)


def arrival_times_of(think_time_s: float, seed: int = 0) -> tuple[list[float], set[float]]:
    engine, clock = slow_engine(step_s=0.1)
    boundaries: set[float] = {0.0}
    step = engine.step

    def noting_step() -> list:  # type: ignore[type-arg]
        out = step()
        boundaries.add(clock.now())
        return out

    engine.step = noting_step  # type: ignore[method-assign]
    specs = [spec(i, max_tokens=3) for i in range(80)]
    config = DriverConfig(num_measured=80, concurrency=4, think_time_s=think_time_s, seed=seed)
    result = run_workload(engine, clock, specs, config)
    return sorted(r.arrival_s for r in result.records), boundaries


def test_think_time_spreads_closed_loop_arrivals_inside_steps() -> None:
    without, boundaries = arrival_times_of(0.0)
    assert set(without) <= boundaries  # no think time: every arrival is a step boundary
    spread, boundaries = arrival_times_of(2.0)
    inside = [t for t in spread if t not in boundaries]
    assert len(inside) >= 0.9 * len(spread)
    # 4 clients, each ~0.3 s of service then ~2 s of thinking: about 4 / 2.3 requests per s.
    rate = len(spread) / (spread[-1] - spread[0])
    assert 1.0 < rate < 2.6


def test_think_times_follow_the_seed() -> None:
    assert arrival_times_of(1.0, seed=1)[0] == arrival_times_of(1.0, seed=1)[0]
    assert arrival_times_of(1.0, seed=1)[0] != arrival_times_of(1.0, seed=2)[0]


def _last_measured_rejected(fast: bool) -> DriverResult:
    """Two warm-up requests, one still decoding; the one measured request can never fit."""
    executor = build_sim_executor("llama-3.1-70b", "a100-80gb", 4, max_model_len=1000)
    clock = VirtualClock()
    engine = Engine(EngineConfig(), "fcfs", executor, clock, fast=fast)
    specs = [
        RequestSpec(0, Tier.P1, "a", tuple(range(1, 20)), 200),
        RequestSpec(1, Tier.P1, "a", tuple(range(1, 10)), 1),
        RequestSpec(2, Tier.P1, "a", tuple(range(1, 2000)), 5),  # over max_model_len: rejected
    ]
    config = DriverConfig(num_measured=1, num_warmup=2, concurrency=2, think_time_s=0.0)
    return run_workload(engine, clock, specs, config)


def test_the_window_closes_at_the_same_step_in_both_simulation_modes() -> None:
    """The last measured request rejected on arrival closes the window after one more step;
    the fast simulation must not leap past it (it leapt to the warm-up's end before)."""
    step, fast = _last_measured_rejected(fast=False), _last_measured_rejected(fast=True)
    assert step.stats.num_steps == fast.stats.num_steps == 2 and step.end_s == fast.end_s
    assert [(r.request_id, r.status, r.num_output_tokens) for r in step.records] == [
        (r.request_id, r.status, r.num_output_tokens) for r in fast.records
    ]
    assert fast.records[-1].status is RequestStatus.ABORTED  # the warm-up still decoding
