"""Nobody is preempted for a waiting request unless it can then get its blocks: not for a
seat (sglang-priority took a running request's seat for a P0 that could not get the memory,
and the victim waited behind it), and not by counting a prefix two victims share once per
holder (both went, and the P0 still did not fit)."""

from __future__ import annotations

from dataclasses import replace

from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig
from tierserve.engine import Engine
from tierserve.executors.sim.executor import build_sim_executor
from tierserve.request import Request, RequestStatus, SamplingParams
from tierserve.tiers import Tier


def _engine(policy: str, blocks: int, **scheduler: int) -> Engine:
    config = EngineConfig()
    config = replace(config, scheduler=replace(config.scheduler, **scheduler))
    executor = build_sim_executor("llama-3.1-70b", "a100-80gb", 8, block_size=16, num_device_blocks=blocks)
    return Engine(config, policy, executor, VirtualClock())


def _request(
    rid: str, first: int, num_prompt: int, tier: Tier, at: float, prefix: tuple[int, ...] = ()
) -> Request:
    prompt = prefix + tuple(range(first, first + num_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=60, ignore_eos=True), tier=tier, arrival_time=at)


def test_a_seat_is_not_taken_for_a_request_that_still_would_not_fit() -> None:
    eng = _engine("sglang-priority", blocks=40, max_num_seqs=2)
    p1, p3 = _request("p1", 1000, 400, Tier.P1, 0.0), _request("p3", 5000, 40, Tier.P3, 0.0)
    eng.add_request(p1)
    eng.add_request(p3)
    for _ in range(3):
        eng.step()
    # 11 free + P3's 3 < the P0's 20 blocks, and P1 is within the preemption threshold of P0
    p0 = _request("p0", 9000, 320, Tier.P0, eng.clock.now())
    eng.add_request(p0)
    eng.step()
    assert p0.status is RequestStatus.WAITING
    assert p3.status is RequestStatus.RUNNING and p3.num_preemptions == 0


def test_a_prefix_two_victims_share_is_counted_once() -> None:
    eng = _engine("sglang-priority", blocks=40)
    shared = tuple(range(5000, 5160))  # 10 blocks
    filler = _request("p1", 1000, 316, Tier.P1, 0.0)
    a = _request("a", 7000, 16, Tier.P3, 0.0, shared)
    for r in (filler, a):
        eng.add_request(r)
    eng.step()
    eng.step()
    b = _request("b", 8000, 16, Tier.P3, eng.clock.now(), shared)
    eng.add_request(b)
    eng.step()
    eng.step()
    assert b.num_cached_tokens == 160
    # 6 free + the 14 blocks a and b hold between them < the P0's 25 (counted once each: 30)
    p0 = _request("p0", 9000, 25 * 16 - 20, Tier.P0, eng.clock.now())
    eng.add_request(p0)
    eng.step()
    assert p0.status is RequestStatus.WAITING
    assert (a.num_preemptions, b.num_preemptions) == (0, 0)


def test_no_victim_goes_for_a_request_that_a_floor_still_keeps_out() -> None:
    """Counting free blocks alone, strict preempted a P3 for a P2 request that P0's unfilled
    floor still kept out: the P3 lost its work and the P2 still waited."""
    from tierserve.config import DEFAULT_TIERS
    from tierserve.executors.null import NullExecutor

    floors = {Tier.P0: 0.3, Tier.P1: 0.0, Tier.P2: 0.0, Tier.P3: 0.0}
    tiers = {t: replace(DEFAULT_TIERS[t], floor=floors[t], reserve=0.0, ceiling=1.0) for t in Tier}
    engine = Engine(
        EngineConfig(tiers=tiers), "strict", NullExecutor(num_device_blocks=10, block_size=4), VirtualClock()
    )
    p1 = Request(
        "p1", tuple(range(17)), SamplingParams(max_tokens=3, ignore_eos=True), tier=Tier.P1
    )  # 5 blocks
    p3 = Request(
        "p3", tuple(range(100, 105)), SamplingParams(max_tokens=3, ignore_eos=True), tier=Tier.P3
    )  # 2
    for r in (p1, p3):
        engine.add_request(r)
    engine.step()
    assert p1.status is p3.status is RequestStatus.RUNNING
    # 3 blocks free, all of them P0's unfilled floor; P3's 2 would leave the P2 request 2 of its 3
    p2 = Request("p2", tuple(range(200, 210)), SamplingParams(max_tokens=3, ignore_eos=True), tier=Tier.P2)
    engine.add_request(p2)
    engine.step()
    assert p2.status is RequestStatus.WAITING and p3.num_preemptions == 0


def _holder_beside_a_p3(
    engine: Engine, tier: Tier, num_blocks: int, sizes: tuple[int, int, int]
) -> tuple[tuple[int, ...], Request, Request]:
    """A request of `tier` holding a prompt of `num_blocks` 4-token blocks (and a token),
    beside a P3; `sizes`: its max_tokens, the P3's prompt tokens and max_tokens."""
    shared = tuple(range(10_000, 10_000 + 4 * num_blocks))
    a = Request("a", (*shared, 1), SamplingParams(max_tokens=sizes[0], ignore_eos=True), tier=tier)
    p3_prompt = tuple(range(50_000, 50_000 + sizes[1]))
    p3 = Request("p3", p3_prompt, SamplingParams(max_tokens=sizes[2], ignore_eos=True), tier=Tier.P3)
    for r in (a, p3):
        engine.add_request(r)
    return shared, a, p3


def test_a_p0_behind_a_prompt_someone_holds_is_charged_only_its_new_blocks() -> None:
    """Charged its whole length (31 blocks beside the 33 P0 held, over its ceiling of 40), a
    P0 whose prompt is a system prompt a running P0 holds was refused the P3's seat, and
    waited until the holder ended; it needs one new block."""
    from tierserve.executors.null import NullExecutor

    config = EngineConfig()
    config = replace(config, scheduler=replace(config.scheduler, max_num_seqs=2))
    engine = Engine(config, "hybrid", NullExecutor(num_device_blocks=100, block_size=4), VirtualClock())
    shared, a, p3 = _holder_beside_a_p3(engine, Tier.P0, 30, (20, 80, 60))
    for _ in range(5):
        engine.step()
    b = Request("b", (*shared, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True), tier=Tier.P0)
    b.arrival_time = engine.clock.now()
    engine.add_request(b)
    engine.step()
    assert b.status is RequestStatus.RUNNING and b.num_cached_tokens == 120
    assert p3.num_preemptions == 1 and a.status is RequestStatus.RUNNING


def test_a_p1_behind_a_prompt_another_p1_holds_reclaims_within_its_entitlement() -> None:
    """Hybrid's gate asked whether the whole prompt fit P1's floor and reserve (21 blocks
    beside the 21 P1 held, over 30) though admission would charge it one: the P3 kept its
    borrowed blocks and the P1 request waited for memory, step after step."""
    from tierserve.executors.null import NullExecutor

    engine = Engine(
        EngineConfig(), "hybrid", NullExecutor(num_device_blocks=100, block_size=4), VirtualClock()
    )
    shared, _, p3 = _holder_beside_a_p3(engine, Tier.P1, 20, (30, 253, 20))
    for _ in range(12):
        engine.step()
        if engine.memory.pool.used_by_tier[Tier.P3] == 64:
            break
    assert engine.memory.borrowed_blocks(Tier.P3) > 0 and engine.memory.num_free_blocks < 2 + 15
    b = Request("b", (*shared, 2, 3), SamplingParams(max_tokens=4, ignore_eos=True), tier=Tier.P1)
    b.arrival_time = engine.clock.now()
    engine.add_request(b)
    engine.step()
    assert b.status is RequestStatus.RUNNING and p3.num_preemptions == 1
