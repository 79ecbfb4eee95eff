"""Engine behaviour: batching limits, chunked prefill, outcomes, aborts, rejections."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import make_request
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, SchedulerConfig
from tierserve.engine import Engine
from tierserve.executors.null import NullExecutor
from tierserve.request import EventKind, FinishReason, Request, RequestStatus
from tierserve.scheduling import POLICIES
from tierserve.tiers import ALL_TIERS, Tier


def engine(policy: str = "hybrid", blocks: int = 256, host: int = 256, **sched: int | float) -> Engine:
    config = EngineConfig(scheduler=SchedulerConfig(**sched))  # type: ignore[arg-type]
    executor = NullExecutor(num_device_blocks=blocks, num_host_blocks=host, block_size=16)
    return Engine(config, policy, executor, VirtualClock())


def run(eng: Engine, limit: int = 100_000) -> None:
    for _ in range(limit):
        if not eng.has_unfinished():
            return
        eng.step()
        eng.memory.check_integrity()
    raise AssertionError("engine did not finish")


def test_a_request_runs_prefill_then_decodes_to_max_tokens() -> None:
    eng = engine()
    req = make_request(num_prompt=40, max_tokens=5)
    assert eng.add_request(req)
    run(eng)
    assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.LENGTH
    assert req.num_output_tokens == 5
    kinds = [e.kind for e in req.events]
    assert kinds == [EventKind.ARRIVED, EventKind.ADMITTED, EventKind.FIRST_TOKEN, EventKind.FINISHED]
    assert req.arrival_time <= req.admitted_time <= req.first_token_time <= req.finish_time  # type: ignore[operator]
    assert eng.memory.num_free_blocks == eng.memory.num_blocks


def test_the_thread_clock_is_read_only_when_the_engine_is_asked_to_time_its_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The thread clock is a system call, slow on a busy host: a simulation never reads it."""
    reads = []
    monkeypatch.setattr("tierserve.engine.engine.time.thread_time", lambda: reads.append(1) or 0.0)
    eng = engine()
    eng.add_request(make_request(num_prompt=40, max_tokens=5))
    run(eng)
    assert reads == []
    eng.time_schedule = True
    eng.add_request(make_request(num_prompt=40, max_tokens=5))
    passes = 0
    while eng.has_unfinished():
        eng.step()
        passes += 1
    assert passes > 0 and len(reads) == 2 * passes  # before the pass and after it


def test_stop_tokens_and_eos_end_a_request_early() -> None:
    eng = engine()
    stopper = make_request(max_tokens=50, stop_token_ids=(7,))  # NullExecutor samples 7
    eng.add_request(stopper)
    run(eng)
    assert stopper.finish_reason is FinishReason.STOP and stopper.num_output_tokens == 1
    eos = Engine(EngineConfig(), "fcfs", NullExecutor(eos_token_ids=(7,)), VirtualClock())
    ends, ignores = make_request(max_tokens=9), make_request(max_tokens=9, ignore_eos=True)
    eos.add_request(ends)
    eos.add_request(ignores)
    run(eos)
    assert ends.num_output_tokens == 1 and ignores.num_output_tokens == 9


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_token_budget_and_max_sequences_hold_every_step(policy: str) -> None:
    eng = engine(policy, blocks=2000, max_num_batched_tokens=256, max_num_seqs=8)
    rng = random.Random(1)
    for i in range(60):
        eng.add_request(
            make_request(num_prompt=rng.randint(1, 700), max_tokens=rng.randint(1, 30), tier=Tier(i % 4))
        )
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    run(eng)
    assert executor.batches
    for batch in executor.batches:
        assert batch.num_tokens <= 256
        assert len(batch) <= 8
        assert all(s.num_tokens == 1 for s in batch.decodes)
        ids = [s.request.request_id for s in batch.seqs]
        assert len(ids) == len(set(ids)), "a request appears twice in one step"


def test_long_prompts_below_p0_are_chunked_to_4096_tokens() -> None:
    eng = engine("hybrid", blocks=4000, max_num_batched_tokens=16384)
    long_p1 = make_request(num_prompt=10000, max_tokens=1, tier=Tier.P1)
    long_p0 = make_request(num_prompt=10000, max_tokens=1, tier=Tier.P0)
    eng.add_request(long_p1)
    eng.step()
    first = eng.executor.batches[0]  # type: ignore[attr-defined]
    assert [s.num_tokens for s in first.prefills] == [4096]
    run(eng)
    eng2 = engine("hybrid", blocks=4000, max_num_batched_tokens=16384)
    eng2.add_request(long_p0)
    eng2.step()
    assert [s.num_tokens for s in eng2.executor.batches[0].prefills] == [10000]  # type: ignore[attr-defined]


def test_decodes_come_before_prefill_chunks() -> None:
    eng = engine("fcfs", max_num_batched_tokens=64)
    a = make_request(num_prompt=10, max_tokens=20)
    eng.add_request(a)
    eng.step()  # a prefills and samples its first token
    b = make_request(num_prompt=500, max_tokens=2)
    eng.add_request(b)
    eng.step()
    batch = eng.executor.batches[-1]  # type: ignore[attr-defined]
    assert [s.request for s in batch.decodes] == [a]
    assert [(s.request, s.num_tokens) for s in batch.prefills] == [(b, 63)]


def test_requests_that_can_never_fit_are_rejected_with_the_reason() -> None:
    eng = Engine(
        EngineConfig(), "hybrid", NullExecutor(num_device_blocks=100, max_model_len=1000), VirtualClock()
    )
    too_long = make_request(num_prompt=900, max_tokens=200)
    assert not eng.add_request(too_long)
    assert too_long.status is RequestStatus.REJECTED and "context of 1000" in too_long.reject_reason
    over_ceiling = make_request(num_prompt=700, max_tokens=10, tier=Tier.P0)  # P0 ceiling: 40 blocks
    assert not eng.add_request(over_ceiling)
    assert "tier P0 may hold at most 40 blocks" in over_ceiling.reject_reason
    assert eng.stats.num_rejected == 2 and not eng.has_unfinished()


@pytest.mark.parametrize("state", ["waiting", "running", "swapped"])
def test_abort_in_every_state_frees_everything(state: str) -> None:
    eng = engine("hybrid", blocks=40, host=64, swap_factor=1e9)
    victim = make_request(num_prompt=480, max_tokens=20, tier=Tier.P3)
    eng.add_request(victim)
    if state != "waiting":
        eng.step()
        eng.step()
    if state == "swapped":
        # A P0 request needs the memory: the P3 request is swapped out.
        eng.add_request(make_request(num_prompt=200, max_tokens=10, tier=Tier.P0))
        eng.step()
    assert victim.status.value == state
    assert eng.abort(victim.request_id)
    assert victim.status is RequestStatus.ABORTED and victim.finish_reason is FinishReason.ABORTED
    assert not victim.block_ids and not victim.host_block_ids
    eng.memory.check_integrity()
    run(eng)
    assert eng.memory.num_free_blocks == eng.memory.num_blocks
    assert eng.memory.host.num_free == eng.memory.host.num_blocks
    assert not eng.abort(victim.request_id), "a second abort finds nothing"


@settings(max_examples=25, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 10_000),
    blocks=st.integers(40, 400),
    swap_factor=st.sampled_from([0.0, 0.3, 1e9]),
)
def test_every_request_ends_exactly_once(policy: str, seed: int, blocks: int, swap_factor: float) -> None:
    rng = random.Random(seed)
    eng = engine(
        policy,
        blocks=blocks,
        host=blocks // 2,
        max_num_batched_tokens=512,
        max_num_seqs=32,
        swap_factor=swap_factor,
    )
    reqs: list[Request] = []
    ended: dict[str, int] = {}
    for _i in range(80):
        r = make_request(
            num_prompt=rng.randint(1, 400),
            max_tokens=rng.randint(1, 200),
            tier=rng.choice(ALL_TIERS),
            arrival=eng.clock.now(),
        )
        eng.add_request(r)
        reqs.append(r)
        if rng.random() < 0.1:
            eng.abort(rng.choice(reqs).request_id)
        for out in eng.step():
            if out.finished:
                ended[out.request.request_id] = ended.get(out.request.request_id, 0) + 1
        eng.memory.check_integrity()
    for _ in range(200_000):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            if out.finished:
                ended[out.request.request_id] = ended.get(out.request.request_id, 0) + 1
        eng.memory.check_integrity()
    assert not eng.has_unfinished()
    for r in reqs:
        assert r.status.is_final
        assert [e.kind for e in r.events].count(EventKind.ARRIVED) == 1
        final = [e for e in r.events if e.kind in (EventKind.FINISHED, EventKind.REJECTED, EventKind.ABORTED)]
        assert len(final) == 1, (r.request_id, r.events)
        if r.status is RequestStatus.FINISHED:
            assert ended[r.request_id] == 1
            assert r.num_output_tokens <= r.sampling.max_tokens
    stats = eng.stats
    assert stats.num_finished + stats.num_rejected + stats.num_aborted == len(reqs)
    assert eng.memory.num_free_blocks == eng.memory.num_blocks
