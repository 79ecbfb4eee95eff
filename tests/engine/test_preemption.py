"""Preemption: who is chosen, how (swap or recompute), when, and how they come back."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import make_request
from tierserve.clock import VirtualClock
from tierserve.config import DEFAULT_TIERS, EngineConfig, SchedulerConfig
from tierserve.engine import Engine
from tierserve.executors.base import StepBatch
from tierserve.executors.null import NullExecutor
from tierserve.request import EventKind, Request, RequestStatus
from tierserve.scheduling.hybrid import HybridOptions
from tierserve.tiers import Tier


def make_engine(
    policy: str = "hybrid",
    blocks: int = 100,
    host: int = 200,
    swap_factor: float = 0.3,
    max_num_seqs: int = SchedulerConfig.max_num_seqs,
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
    **executor_kw: object,
) -> Engine:
    executor = NullExecutor(
        num_device_blocks=blocks,
        num_host_blocks=host,
        block_size=16,
        **executor_kw,  # type: ignore[arg-type]
    )
    # p3_yields off: these tests start requests of several tiers in one step.
    config = EngineConfig(
        scheduler=SchedulerConfig(
            swap_factor=swap_factor, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
        policy_options={"hybrid": HybridOptions(p3_yields=False, p0_likely_s=0.0)},
    )
    return Engine(config, policy, executor, VirtualClock())


def start(eng: Engine, *reqs: Request) -> None:
    """Admit and prefill the requests (each gets its first token)."""
    for r in reqs:
        assert eng.add_request(r)
    eng.step()
    for r in reqs:
        assert r.status is RequestStatus.RUNNING and r.num_output_tokens == 1, r


def crowd(eng: Engine, max_tokens: int = 50) -> Request:
    """A running P3 request holding 70 of the 100 blocks."""
    p3 = make_request(num_prompt=16 * 70 - 1, max_tokens=max_tokens, tier=Tier.P3)
    start(eng, p3)
    return p3


def big_p0(arrival: float = 0.0) -> Request:
    """A P0 request that needs 35 blocks: more than are free beside `crowd`."""
    return make_request(num_prompt=16 * 35 - 1, max_tokens=3, tier=Tier.P0, arrival=arrival)


def run(eng: Engine) -> None:
    for _ in range(10_000):
        if not eng.has_unfinished():
            return
        eng.step()
        eng.memory.check_integrity()
    raise AssertionError("engine did not finish")


def test_victims_are_lowest_tier_first_then_least_work_lost() -> None:
    eng = make_engine(blocks=100, swap_factor=0.0)  # P0: floor 15, ceiling 40 blocks
    p1 = make_request(num_prompt=16 * 20 - 1, max_tokens=50, tier=Tier.P1)
    p2 = make_request(num_prompt=16 * 20 - 1, max_tokens=50, tier=Tier.P2)
    p3_big = make_request(num_prompt=16 * 25 - 1, max_tokens=50, tier=Tier.P3)
    p3_small = make_request(num_prompt=16 * 15 - 1, max_tokens=50, tier=Tier.P3)
    start(eng, p1, p2, p3_big, p3_small)  # 80 blocks used, 20 free
    p0 = make_request(num_prompt=16 * 30 - 1, max_tokens=5, tier=Tier.P0)  # needs 30
    eng.add_request(p0)
    eng.step()
    assert p0.status is RequestStatus.RUNNING
    assert p3_small.status is RequestStatus.WAITING, "the P3 with least work lost goes first"
    assert p3_big.status is RequestStatus.RUNNING and p2.status is RequestStatus.RUNNING
    assert eng.stats.preemptions[(Tier.P3, "recompute")] == 1


def test_swap_when_the_host_link_is_cheap_enough_else_recompute() -> None:
    # NullExecutor: swap = 1e-4 s per block, prefill = 0.01 + 1e-5 s per token.
    # 70 blocks: swap 7 ms; prefill of 1,120 tokens: 21.2 ms.
    for factor, expected in ((0.5, "swap"), (0.3, "recompute")):
        eng = make_engine(swap_factor=factor)
        p3 = crowd(eng)
        eng.add_request(big_p0())
        eng.step()
        assert dict(eng.stats.preemptions) == {(Tier.P3, expected): 1}, factor
        kind = EventKind.PREEMPTED_SWAP if expected == "swap" else EventKind.PREEMPTED_RECOMPUTE
        assert p3.events[-1].kind is kind
        run(eng)
        assert p3.num_output_tokens == 50


def test_swap_falls_back_to_recompute_when_the_host_pool_is_full() -> None:
    eng = make_engine(host=5, swap_factor=1e9)
    crowd(eng)
    eng.add_request(big_p0())
    eng.step()
    assert dict(eng.stats.preemptions) == {(Tier.P3, "recompute"): 1}


def test_swapped_requests_resume_with_their_progress() -> None:
    eng = make_engine(swap_factor=1e9)
    p3 = crowd(eng, max_tokens=30)
    for _ in range(4):
        eng.step()
    progress = p3.num_computed_tokens
    assert p3.num_output_tokens == 5
    eng.add_request(big_p0())
    eng.step()
    assert p3.status is RequestStatus.SWAPPED and p3.num_computed_tokens == progress
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    moved_out = list(executor.swapped_out)
    run(eng)
    assert p3.num_output_tokens == 30 and p3.num_preemptions == 1
    assert [h for h, _ in executor.swapped_in] == [h for _, h in moved_out]
    # Once back, it never prefilled again: every later chunk of it was a one-token decode.
    swapped_in_at = next(i for i, e in enumerate(p3.events) if e.kind is EventKind.SWAPPED_IN)
    assert swapped_in_at > 0
    chunks = [s.num_tokens for b in executor.batches for s in b.seqs if s.request is p3]
    assert chunks[0] == 16 * 70 - 1 and set(chunks[1:]) == {1}


def test_recomputed_requests_prefill_their_output_again() -> None:
    eng = make_engine(swap_factor=0.0)
    p3 = crowd(eng, max_tokens=30)
    for _ in range(3):
        eng.step()
    eng.add_request(big_p0())
    eng.step()
    assert p3.status is RequestStatus.WAITING and p3.num_computed_tokens == 0
    assert p3.num_output_tokens == 4, "generated tokens are kept and prefilled again"
    run(eng)
    assert p3.num_output_tokens == 30
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    chunks = [s.num_tokens for b in executor.batches for s in b.seqs if s.request is p3]
    again = next(c for c in chunks[1:] if c > 1)  # the recompute's chunk, after the decodes
    # Prompt and output together, less the leading blocks the prefix cache kept (freed last
    # block first, the P0's allocation evicted the tail): what is left is whole blocks.
    assert again > 4 and (16 * 70 - 1 + 4 - again) % 16 == 0, chunks[:8]


def test_swapped_requests_come_back_before_new_admissions_of_their_tier() -> None:
    eng = make_engine(swap_factor=1e9)
    p3 = crowd(eng, max_tokens=20)
    eng.add_request(big_p0())
    eng.step()
    assert p3.status is RequestStatus.SWAPPED
    newcomer = make_request(num_prompt=10, max_tokens=2, tier=Tier.P3, arrival=eng.clock.now())
    eng.add_request(newcomer)
    run(eng)
    swapped_in = next(e.time for e in p3.events if e.kind is EventKind.SWAPPED_IN)
    assert newcomer.admitted_time is not None and newcomer.admitted_time >= swapped_in


def test_a_victim_named_during_a_step_leaves_at_the_step_boundary() -> None:
    holder: dict[str, Engine] = {}
    target = make_request(num_prompt=20, max_tokens=50, tier=Tier.P2)
    aborted = make_request(num_prompt=20, max_tokens=50, tier=Tier.P2)
    calls = {"n": 0}

    def mid_step(batch: StepBatch) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            eng = holder["eng"]
            assert eng.preempt(target.request_id)
            assert eng.abort(aborted.request_id)
            # Nothing has moved yet: both are still running and hold their blocks.
            assert target.status is RequestStatus.RUNNING and target.block_ids
            assert aborted.status is RequestStatus.RUNNING and aborted.block_ids

    eng = make_engine(on_execute=mid_step)
    holder["eng"] = eng
    start(eng, target, aborted)
    eng.step()
    before = (target.num_output_tokens, aborted.num_output_tokens)
    outputs = eng.step()  # the third execute: both are named mid-step
    # The step they were in completed for both of them ...
    assert (target.num_output_tokens, aborted.num_output_tokens) == (before[0] + 1, before[1] + 1)
    # ... and the abort took effect at its end.
    assert aborted.status is RequestStatus.ABORTED and not aborted.block_ids
    assert any(o.request is aborted and o.finished for o in outputs)
    assert target.status is RequestStatus.RUNNING
    eng.step()  # the next pass takes the named victim
    assert target.status in (RequestStatus.SWAPPED, RequestStatus.WAITING)
    run(eng)
    assert target.num_output_tokens == 50


def test_hybrid_p0_reclaims_memory_that_vllm_priority_makes_it_wait_for() -> None:
    results = {}
    for policy in ("hybrid", "vllm-priority"):
        eng = make_engine(policy)
        crowd(eng, max_tokens=200)
        p0 = big_p0(arrival=eng.clock.now())
        eng.add_request(p0)
        eng.step()
        results[policy] = p0.status
        if policy == "vllm-priority":
            assert eng.stats.num_preemptions() == 0, "a waiting request never preempts in vLLM"
        run(eng)
    assert results == {"hybrid": RequestStatus.RUNNING, "vllm-priority": RequestStatus.WAITING}


def test_vllm_priority_preempts_the_lowest_running_by_recompute_only() -> None:
    eng = make_engine("vllm-priority", blocks=24, swap_factor=1e9)
    high = make_request(num_prompt=16 * 8, max_tokens=100, tier=Tier.P1, arrival=0.0)
    low_old = make_request(num_prompt=16 * 8, max_tokens=100, tier=Tier.P3, arrival=1.0)
    low_new = make_request(num_prompt=16 * 8, max_tokens=100, tier=Tier.P3, arrival=2.0)
    start(eng, high, low_old, low_new)  # 24 blocks, all full
    eng.step()  # everyone needs a new block: the newest P3 goes, by recompute
    assert low_new.status is RequestStatus.WAITING
    assert high.status is RequestStatus.RUNNING
    assert set(eng.stats.preemptions) == {(Tier.P3, "recompute")}


def test_aging_bounds_the_wait_of_p3_behind_a_p1_flood() -> None:
    config = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=4))
    eng = Engine(config, "hybrid", NullExecutor(num_device_blocks=400, step_s=0.05), VirtualClock())
    p3 = make_request(num_prompt=50, max_tokens=5, tier=Tier.P3)
    eng.add_request(p3)
    aging = config.tiers[Tier.P3].aging_s
    for _i in range(2000):
        now = eng.clock.now()
        if eng.num_waiting(Tier.P1) < 20:  # keep a P1 backlog at all times
            eng.add_request(make_request(num_prompt=50, max_tokens=20, tier=Tier.P1, arrival=now))
        eng.step()
        if p3.status.is_final or now > 4 * aging:
            break
    assert p3.admitted_time is not None, "P3 starved behind the P1 flood"
    assert p3.admitted_time - p3.arrival_time <= aging + 2.0  # a couple of 50 ms steps of slack


def test_aging_never_hands_out_p0_reserved_memory() -> None:
    tiers = dict(EngineConfig().tiers)
    tiers[Tier.P1] = replace(tiers[Tier.P1], reserve=0.0, aging_s=30.0)  # nothing to reclaim; ages
    config = EngineConfig(tiers=tiers)
    eng = Engine(config, "hybrid", NullExecutor(num_device_blocks=100, step_s=1.0), VirtualClock())
    filler = make_request(num_prompt=16 * 85 - 48, max_tokens=48, tier=Tier.P2)  # grows to 85 blocks
    start(eng, filler)
    old_p1 = make_request(num_prompt=16 * 5, max_tokens=5, tier=Tier.P1)
    eng.add_request(old_p1)
    for _ in range(40):  # 40 s: beyond P1's 30 s aging threshold
        eng.step()
        assert eng.memory.num_free_blocks >= eng.memory.partition.floor[Tier.P0]
    assert eng.clock.now() - old_p1.arrival_time > config.tiers[Tier.P1].aging_s
    assert old_p1.status is RequestStatus.WAITING and filler.status is RequestStatus.RUNNING
    assert eng.memory.used_blocks(Tier.P1) == 0
    run(eng)
    assert old_p1.num_output_tokens == 5


def test_a_p0_that_waits_for_memory_a_lower_tier_holds_is_counted() -> None:
    """fcfs never reclaims: the P0 waits for the P3's blocks, once per pass, and the count
    says so; hybrid reclaims them in the same pass, so its P0 never waits."""
    for policy, waits in (("fcfs", True), ("hybrid", False)):
        eng = make_engine(policy, swap_factor=0.0)
        p3 = crowd(eng)
        p0 = big_p0()
        eng.add_request(p0)
        eng.step()
        eng.step()
        assert (p0.num_memory_waits == 2) is waits, (policy, p0.num_memory_waits)
        assert (p0.num_memory_waits == 0) is not waits
        run(eng)
        assert p3.num_memory_waits == 0  # it never waited: it was first


def one_seat_engine() -> Engine:
    return make_engine(blocks=100, host=200, swap_factor=1e9, max_num_seqs=1)


def swapped_out_for_a_p0(eng: Engine, victim: Request, p0_prompt: int, then: Tier) -> Request:
    """`victim` runs, a P0 of `p0_prompt` tokens swaps it out, a request of tier `then`
    arrives while the P0 runs; returns that request after the pass that follows the P0's end."""
    start(eng, victim)
    p0 = make_request(num_prompt=p0_prompt, max_tokens=3, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    eng.step()
    assert victim.status is RequestStatus.SWAPPED and p0.status is RequestStatus.RUNNING
    waiting = make_request(num_prompt=p0_prompt, max_tokens=3, tier=then, arrival=eng.clock.now())
    eng.add_request(waiting)
    while p0.status is RequestStatus.RUNNING:
        eng.step()
    eng.step()  # the pass after the P0 ended
    return waiting


def test_a_swapped_request_leaves_the_only_seat_to_a_waiting_p0() -> None:
    # One seat: a P1 swapped out for one P0 does not come back into the seat a second,
    # waiting P0 takes in the same pass (swapped in, it was swapped out again for that P0
    # a pass later: two swaps for nothing, and the P0 a step late).
    eng = one_seat_engine()
    p1 = make_request(num_prompt=50, max_tokens=40, tier=Tier.P1)
    second = swapped_out_for_a_p0(eng, p1, 20, Tier.P0)
    assert second.status is RequestStatus.RUNNING and p1.status is RequestStatus.SWAPPED
    run(eng)
    assert p1.num_output_tokens == 40 and p1.num_preemptions == 1
    assert [e.kind for e in p1.events].count(EventKind.PREEMPTED_SWAP) == 1
    assert second.num_memory_waits == 0


def test_a_swapped_request_comes_back_before_a_head_that_may_not_take_its_place() -> None:
    # Hybrid's P2 takes no seat from P3 (while P3 does not step aside): the P3 swapped out
    # for a P0 comes back when the P0 ends, before a P2 that arrived meanwhile.
    eng = one_seat_engine()
    p3 = make_request(num_prompt=50, max_tokens=10, tier=Tier.P3)
    p2 = swapped_out_for_a_p0(eng, p3, 20, Tier.P2)
    assert p3.status is RequestStatus.RUNNING and p2.status is RequestStatus.WAITING
    run(eng)
    assert p3.num_preemptions == 1 and p2.num_output_tokens == 3


def test_a_swapped_request_leaves_the_blocks_a_waiting_p0_can_take() -> None:
    # The same with memory instead of seats: coming back, the P1 would take blocks the
    # waiting P0 needs, and the P0 would wait for memory a lower tier holds.
    eng = make_engine(blocks=100, swap_factor=1e9)  # P0: floor 15, ceiling 40 blocks
    p1 = make_request(num_prompt=16 * 70 - 1, max_tokens=40, tier=Tier.P1)
    second = swapped_out_for_a_p0(eng, p1, 16 * 38 - 1, Tier.P0)
    assert second.status is RequestStatus.RUNNING and p1.status is RequestStatus.SWAPPED
    run(eng)
    assert p1.num_output_tokens == 40 and p1.num_preemptions == 1
    assert second.num_memory_waits == 0


def test_fcfs_brings_swapped_requests_back_oldest_first_whatever_their_tier() -> None:
    # Every running request is of one tier, so that tier holds every used block of the
    # flat pool: the oldest swapped request finding no room stops the others (a ceiling
    # of the whole pool read as that tier's own let a newer, smaller one come back first).
    eng = make_engine("fcfs", blocks=11, swap_factor=1e9)
    a = make_request(num_prompt=16 * 5 + 2, max_tokens=8, tier=Tier.P2, arrival=0.0)  # 6 blocks
    b = make_request(num_prompt=2, max_tokens=8, tier=Tier.P2, arrival=0.001)  # 1 block
    growing = [
        make_request(num_prompt=15, max_tokens=30, tier=Tier.P2, arrival=0.002 + i / 1000) for i in range(4)
    ]  # 1 block each, a second one at their third pass
    start(eng, a, b, *growing)
    assert eng.preempt(a.request_id) and eng.preempt(b.request_id)
    eng.step()
    assert a.status is RequestStatus.SWAPPED and b.status is RequestStatus.SWAPPED
    eng.step()  # the four grow into 4 of the 7 free blocks: 3 left, too few for `a`
    assert eng.memory.num_free_blocks == 3
    assert a.status is RequestStatus.SWAPPED and b.status is RequestStatus.SWAPPED
    run(eng)
    back = {r.request_id: next(e.time for e in r.events if e.kind is EventKind.SWAPPED_IN) for r in (a, b)}
    assert back[a.request_id] <= back[b.request_id]


def _three_running_one_swapped(eng: Engine, s_blocks: int) -> tuple[Request, Request, Request]:
    """A P3 (40 blocks) and a P1 (10) run beside a P2 (`s_blocks`) that is then swapped out."""
    p3 = make_request(num_prompt=16 * 40 - 20, max_tokens=19, tier=Tier.P3)
    p1 = make_request(num_prompt=16 * 10 - 20, max_tokens=19, tier=Tier.P1)
    p2 = make_request(num_prompt=16 * s_blocks - 20, max_tokens=19, tier=Tier.P2)
    start(eng, p3, p1, p2)
    assert eng.preempt(p2.request_id)
    eng.step()
    assert p2.status is RequestStatus.SWAPPED
    return p3, p1, p2


@pytest.mark.parametrize("room", ["seat", "blocks"])
def test_a_swapped_request_comes_back_where_the_head_would_take_another_first(room: str) -> None:
    # A P0 arrives needing the one seat left (3 seats) or more blocks than the P2 would
    # leave free (100 blocks): it would take the running P3's first, by the victim order,
    # so the P2 comes back and the P3 makes room (a review's repro: held out for the P0,
    # the P2 waited swapped out while the P3 kept its place).
    if room == "seat":
        eng = make_engine(blocks=1000, host=1000, swap_factor=1e9, max_num_seqs=3)
        p0_blocks = 2
    else:
        eng = make_engine(blocks=100, swap_factor=1e9)
        p0_blocks = 35
    p3, p1, p2 = _three_running_one_swapped(eng, 30)
    p0 = make_request(num_prompt=16 * p0_blocks - 1, max_tokens=10, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    eng.step()
    assert p2.status is RequestStatus.RUNNING and p0.status is RequestStatus.RUNNING
    assert p3.status is not RequestStatus.RUNNING and p1.status is RequestStatus.RUNNING
    run(eng)
    assert p2.num_preemptions == 1


def test_once_one_stays_out_for_the_head_no_later_swapped_request_takes_its_room() -> None:
    # 3 seats: a P3 runs beside a P1, two P3s are swapped out, a P0 arrives for the last
    # seat. The older swapped P3 (its first victim) stays out for it; the newer one must
    # not come back into that seat past it (a review's repro: it did, and the P0 took the
    # running P3's seat instead, so the hold spared nobody).
    eng = make_engine(blocks=1000, host=1000, swap_factor=1e9, max_num_seqs=3)
    running = make_request(num_prompt=100, max_tokens=300, tier=Tier.P3)
    older = make_request(num_prompt=20, max_tokens=300, tier=Tier.P3)
    newer = make_request(num_prompt=300, max_tokens=300, tier=Tier.P3, arrival=0.001)
    start(eng, running, older, newer)
    assert eng.preempt(older.request_id) and eng.preempt(newer.request_id)
    p1 = make_request(num_prompt=50, max_tokens=300, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(p1)
    eng.step()
    assert older.status is RequestStatus.SWAPPED and newer.status is RequestStatus.SWAPPED
    p0 = make_request(num_prompt=20, max_tokens=30, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    eng.step()
    assert p0.status is RequestStatus.RUNNING and running.status is RequestStatus.RUNNING
    assert older.status is RequestStatus.SWAPPED and newer.status is RequestStatus.SWAPPED
    run(eng)


@pytest.mark.parametrize("policy", ["strict", "hybrid"])
def test_a_swapped_request_stays_out_only_for_a_head_the_running_prompts_leave_tokens(policy: str) -> None:
    # 2 seats, 32 tokens a step: a running P0 prefills a long prompt and a short P0 waits
    # for the seat a swapped P2 would take. Under strict the long prompt's chunk takes every
    # token of each step, so the short P0 cannot come in until it is done, and the P2 comes
    # back meanwhile (held out for that head, it lost a step per pass). Hybrid prefills the
    # shorter P0 prompt first (its `prefill_chunk_cap`), so the short P0 comes in at once
    # and the P2 stays out for it (judged by the step's tokens alone, the P2 came back and
    # the short P0 waited 14 passes for its first token).
    eng = make_engine(
        policy, blocks=1000, host=1000, swap_factor=1e9, max_num_seqs=2, max_num_batched_tokens=32
    )
    p2 = make_request(num_prompt=20, max_tokens=100, tier=Tier.P2)
    eng.add_request(p2)
    while p2.num_output_tokens == 0:
        eng.step()
    long_p0 = make_request(num_prompt=400, max_tokens=5, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(long_p0)
    assert eng.preempt(p2.request_id)
    eng.step()
    assert p2.status is RequestStatus.SWAPPED and long_p0.status is RequestStatus.RUNNING
    short_p0 = make_request(num_prompt=20, max_tokens=5, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(short_p0)
    eng.step()
    assert long_p0.is_prefilling
    if policy == "strict":
        assert short_p0.status is RequestStatus.WAITING and p2.status is RequestStatus.RUNNING
    else:
        assert short_p0.num_output_tokens == 1 and p2.status is RequestStatus.SWAPPED
    run(eng)


@pytest.mark.parametrize("policy", ["strict", "article", "hybrid"])
def test_once_one_stays_out_for_the_head_no_later_swapped_prompt_takes_its_tokens(policy: str) -> None:
    # 64 tokens a step: a P3 (X) swapped out would take the blocks a waiting P0 needs and
    # stays out for it; a newer P3 (Y), swapped out early in its prompt, holds few blocks
    # but its next chunk would take every token of the step. It must stay out too: it came
    # back, and under strict and article its chunks took every token until its prompt was
    # done, the P0 waiting, X back in the meantime. (Hybrid keeps a waiting P0's tokens from
    # the other tiers' chunks, `prefill_chunk_cap`: there Y's chunk leaves the P0 its
    # tokens, so Y comes back, and is not swapped out again.)
    eng = make_engine(policy, blocks=100, host=1000, swap_factor=1e9, max_num_batched_tokens=64)
    r = make_request(num_prompt=16 * 35 - 1, max_tokens=300, tier=Tier.P3)
    x = make_request(num_prompt=16 * 32 - 20, max_tokens=300, tier=Tier.P3, arrival=0.001)
    for req in (r, x):
        eng.add_request(req)
        while req.num_output_tokens == 0:
            eng.step()
    y = make_request(num_prompt=250, max_tokens=300, tier=Tier.P3, arrival=eng.clock.now())
    eng.add_request(y)
    eng.step()
    assert y.is_prefilling and y.num_computed_tokens > 0
    assert eng.preempt(x.request_id) and eng.preempt(y.request_id)
    eng.step()
    assert x.status is RequestStatus.SWAPPED and y.status is RequestStatus.SWAPPED
    p0 = make_request(num_prompt=16 * 35 - 1, max_tokens=5, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    eng.step()
    assert p0.status is RequestStatus.RUNNING and p0.num_computed_tokens > 0
    assert x.status is RequestStatus.SWAPPED
    assert y.status is (RequestStatus.RUNNING if policy == "hybrid" else RequestStatus.SWAPPED)
    eng.step()
    assert y.num_preemptions == 1  # not swapped out again at the next pass for the P0
    run(eng)


def test_a_swapped_request_is_judged_a_victim_with_its_own_blocks_counted() -> None:
    # Hybrid's P1 takes blocks only from a borrowing tier. A P3 (X, 25 blocks) is swapped
    # out beside a running P3 (40): only with X's blocks back does P3 borrow (65 blocks
    # past the 55 shared). A P1 needing 25 blocks arrives: X, back, would crowd it out and
    # be its first victim (least work lost), so X stays out and the running P3 runs on. (A
    # review's repro: the victim rule read P3's use without X's blocks, X came back, and
    # the P1 then took the running P3's 40 blocks instead.)
    eng = make_engine(blocks=100, swap_factor=1e9)  # P0: floor 15; P1: reserve 30
    r = make_request(num_prompt=16 * 40 - 20, max_tokens=100, tier=Tier.P3)
    x = make_request(num_prompt=16 * 25 - 20, max_tokens=100, tier=Tier.P3)
    start(eng, r, x)
    assert eng.preempt(x.request_id)
    eng.step()
    assert x.status is RequestStatus.SWAPPED and not eng.memory.is_borrowing(Tier.P3)
    with eng.memory.as_if_back(x):
        assert eng.memory.is_borrowing(Tier.P3)
    assert not eng.memory.is_borrowing(Tier.P3)
    p1 = make_request(num_prompt=16 * 25 - 1, max_tokens=5, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(p1)
    eng.step()
    assert p1.status is RequestStatus.RUNNING and x.status is RequestStatus.SWAPPED
    assert r.status is RequestStatus.RUNNING and r.num_preemptions == 0
    run(eng)


def test_a_swapped_request_stays_out_where_the_victims_before_it_cannot_make_the_heads_room() -> None:
    # A small running P3 (Q, little work) comes before X in the head's victim order, but
    # with X back its blocks alone cannot make room for the P1 head. X stays out, and the
    # head fits in the free blocks. (A review's repro: X came back for Q being first, the
    # head waited a pass and then preempted Q and X: X swapped each way, Q for nothing.)
    eng = make_engine("strict", blocks=100, host=1000, swap_factor=1e9, max_num_batched_tokens=64)
    q = make_request(num_prompt=50, max_tokens=300, tier=Tier.P3)
    x = make_request(num_prompt=16 * 19 - 20, max_tokens=300, tier=Tier.P3, arrival=0.001)
    for req in (q, x):
        eng.add_request(req)
        while req.num_output_tokens == 0:
            eng.step()
    assert eng.preempt(x.request_id)
    eng.step()
    assert x.status is RequestStatus.SWAPPED
    room = eng.memory.num_free_blocks - 15 - 10  # beside P0's floor with X out, not with X back
    head = make_request(num_prompt=16 * room - 1, max_tokens=5, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(head)
    for _ in range(2):
        eng.step()
    assert head.status is RequestStatus.RUNNING and x.status is RequestStatus.SWAPPED
    assert x.num_preemptions == 1 and q.num_preemptions == 0
    run(eng)


def test_a_swapped_decode_is_judged_with_the_block_its_next_token_takes() -> None:
    # X's 25 host blocks back would leave the P1 head exactly its room, but X's next token
    # needs a 26th block, which coming back it takes at once: X stays out. (A review's repro:
    # judged by its host blocks alone it came back, the head found no room and preempted
    # it at the next pass: a swap each way.)
    r = make_request(num_prompt=16 * 20, max_tokens=300, tier=Tier.P1)
    x = make_request(num_prompt=16 * 24, max_tokens=300, tier=Tier.P3, arrival=0.001)
    eng = make_engine("strict", blocks=100, host=1000, swap_factor=1e9, max_num_batched_tokens=64)
    for req in (r, x):
        eng.add_request(req)
    while x.num_tokens < 401:
        eng.step()
    assert len(x.block_ids) == 25
    assert eng.preempt(x.request_id)
    eng.step()
    assert x.status is RequestStatus.SWAPPED
    room = eng.memory.num_free_blocks - 15 - len(x.host_block_ids)
    head = make_request(num_prompt=16 * room - 1, max_tokens=5, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(head)
    for _ in range(2):
        eng.step()
    assert head.status is RequestStatus.RUNNING and x.num_preemptions == 1
    run(eng)


def _behind_the_head(policy: str, victim: Tier, behind: Tier) -> tuple[Engine, Request, list[Request]]:
    """Ten blocks of 4 tokens, no floors or reserves. `victim` (6 blocks, decoding) is
    swapped out for a 9-block P0; a 2-block P0 waits behind that one, and two 4-block
    requests of tier `behind` behind it. Returns them after the pass that follows the
    first P0's end, which leaves room for the second P0 and `victim`, or for the second
    P0 and the two behind it."""
    tiers = {t: replace(c, floor=0.0, reserve=0.0, ceiling=1.0) for t, c in DEFAULT_TIERS.items()}
    config = EngineConfig(
        scheduler=SchedulerConfig(swap_factor=1e9),
        tiers=tiers,
        policy_options={"hybrid": HybridOptions(p3_yields=False, p0_likely_s=0.0)},
    )
    executor = NullExecutor(num_device_blocks=10, num_host_blocks=100, block_size=4)
    eng = Engine(config, policy, executor, VirtualClock())
    a = make_request(num_prompt=16, max_tokens=20, tier=victim)
    eng.add_request(a)
    for _ in range(4):
        eng.step()
    now = eng.clock.now()
    waiting = [
        make_request(num_prompt=n, max_tokens=m, tier=t, arrival=now)
        for n, m, t in ((36, 1, Tier.P0), (5, 4, Tier.P0), (13, 4, behind), (13, 4, behind))
    ]
    for req in waiting:
        eng.add_request(req)
    eng.step()
    assert a.status is RequestStatus.SWAPPED and waiting[0].status is RequestStatus.FINISHED
    eng.step()
    return eng, a, waiting


@pytest.mark.parametrize("policy", ["hybrid", "strict"])
def test_a_swapped_request_leaves_the_room_of_the_waiting_requests_behind_the_head(policy: str) -> None:
    # P1 swapped out, P0s behind the head: `a` coming back leaves room for the head but
    # not for the two behind it, which this pass admits were `a` to stay out. Judged by the
    # head alone, `a` came back and the next pass swapped it out again for them (a swap
    # each way for nothing, and a P0 a step late, counted as waiting for memory a P1 held).
    eng, a, p0s = _behind_the_head(policy, Tier.P1, Tier.P0)
    assert [p.status for p in p0s[1:]] == [RequestStatus.RUNNING] * 3
    assert a.status is RequestStatus.SWAPPED
    run(eng)
    assert a.num_output_tokens == 20 and a.num_preemptions == 1
    assert [e.kind for e in a.events].count(EventKind.PREEMPTED_SWAP) == 1
    assert [p.num_memory_waits for p in p0s] == [0, 0, 0, 0]


@pytest.mark.parametrize(("policy", "comes_back"), [("hybrid", True), ("strict", False)])
def test_the_requests_behind_the_head_keep_a_swapped_request_out_only_where_they_may_take_it(
    policy: str, comes_back: bool
) -> None:
    # A P3 swapped out, P2s behind the P0 head: hybrid's P2 takes no blocks from a P3
    # beyond its entitlement (none here), so the P3 comes back, as it would keep its place
    # running, and the P2s wait; strict's P2 preempts any P3, so the P3 stays out for them.
    _, a, waiting = _behind_the_head(policy, Tier.P3, Tier.P2)
    assert (a.status is RequestStatus.RUNNING) is comes_back
    expected = RequestStatus.WAITING if comes_back else RequestStatus.RUNNING
    assert waiting[1].status is RequestStatus.RUNNING
    assert [r.status for r in waiting[2:]] == [expected] * 2
