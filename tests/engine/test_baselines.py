"""The baselines' defining behaviour: each test fails when that behaviour is removed."""

from __future__ import annotations

import random
from dataclasses import replace

from tests.conftest import make_request
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, parse_config
from tierserve.engine import Engine
from tierserve.executors.null import NullExecutor
from tierserve.request import Request, RequestStatus
from tierserve.tiers import ALL_TIERS, Tier


def make_engine(
    policy: str, blocks: int = 100, config: EngineConfig | None = None, **sched: int | float
) -> Engine:
    config = config or EngineConfig()
    config = replace(config, scheduler=replace(config.scheduler, **sched))  # type: ignore[arg-type]
    executor = NullExecutor(num_device_blocks=blocks, num_host_blocks=200, block_size=16)
    return Engine(config, policy, executor, VirtualClock())


def start(eng: Engine, *reqs: Request) -> None:
    for r in reqs:
        assert eng.add_request(r)
    eng.step()
    for r in reqs:
        assert r.status is RequestStatus.RUNNING and r.num_output_tokens == 1, r


def run(eng: Engine, limit: int = 20_000) -> None:
    for _ in range(limit):
        if not eng.has_unfinished():
            return
        eng.step()
        eng.memory.check_integrity()
    raise AssertionError("engine did not finish")


# ---- vllm-priority ---------------------------------------------------------------------


def test_vllm_priority_never_preempts_for_a_waiting_request() -> None:
    eng = make_engine("vllm-priority", blocks=100, max_num_seqs=2)
    lows = [make_request(num_prompt=16 * 30 - 1, max_tokens=40, tier=Tier.P3) for _ in range(2)]
    start(eng, *lows)  # both seats taken, 60 of 100 blocks
    p0 = make_request(num_prompt=16 * 45, max_tokens=4, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)  # needs a seat and more blocks than are free
    while p0.status is RequestStatus.WAITING:
        eng.step()
        assert eng.stats.num_preemptions() == 0, "a waiting request preempted running work"
    assert all(r.status is RequestStatus.FINISHED for r in lows), "P0 was admitted before a seat freed"
    run(eng)


def test_vllm_priority_admits_nothing_in_a_pass_that_preempted() -> None:
    eng = make_engine("vllm-priority", blocks=24)
    high = make_request(num_prompt=16 * 8, max_tokens=100, tier=Tier.P1, arrival=0.0)
    low_old = make_request(num_prompt=16 * 8, max_tokens=100, tier=Tier.P3, arrival=1.0)
    low_new = make_request(num_prompt=16 * 8, max_tokens=100, tier=Tier.P3, arrival=2.0)
    start(eng, high, low_old, low_new)  # all 24 blocks held
    tiny = make_request(num_prompt=4, max_tokens=2, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(tiny)
    eng.step()  # every running request needs a block: the newest P3 is preempted, 8 blocks free
    assert low_new.status is RequestStatus.WAITING and eng.stats.num_preemptions() == 1
    assert tiny.status is RequestStatus.WAITING, "admitted in a pass that preempted"
    eng.step()
    assert tiny.status is RequestStatus.RUNNING
    run(eng)


def test_vllm_priority_walks_running_in_admission_order_and_a_self_preemption_ends_the_walk() -> None:
    eng = make_engine("vllm-priority", blocks=16)
    low = make_request(num_prompt=126, max_tokens=100, tier=Tier.P3, arrival=0.0)  # 8 blocks
    start(eng, low)
    high = make_request(num_prompt=120, max_tokens=100, tier=Tier.P1, arrival=eng.clock.now())
    start(eng, high)  # admitted after `low`: the walk meets `low` first; all 16 blocks held
    while low.status is RequestStatus.RUNNING:
        high_before = high.num_output_tokens
        eng.step()
    # `low` needed a block first; the largest (priority, arrival) running is `low` itself.
    assert high.status is RequestStatus.RUNNING and eng.stats.num_preemptions() == 1
    assert high.num_output_tokens == high_before, "the walk went on after the requester preempted itself"
    eng.step()
    assert high.num_output_tokens == high_before + 1
    run(eng)


# ---- sglang-priority ---------------------------------------------------------------------


def _seat_contest(running_tier: Tier, config: EngineConfig | None = None) -> tuple[Request, Engine]:
    eng = make_engine("sglang-priority", blocks=200, config=config, max_num_seqs=1)
    victim = make_request(num_prompt=64, max_tokens=200, tier=running_tier)
    start(eng, victim)
    p0 = make_request(num_prompt=64, max_tokens=4, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    eng.step()
    return p0, eng


def test_sglang_priority_preempts_only_past_its_threshold() -> None:
    # Tiers are SGLang priorities 30/20/10/0; the default threshold is 10 (a gap must exceed it).
    p0, eng = _seat_contest(Tier.P1)  # gap 10: not over the threshold
    assert p0.status is RequestStatus.WAITING and eng.stats.num_preemptions() == 0
    p0, eng = _seat_contest(Tier.P2)  # gap 20
    assert p0.status is RequestStatus.RUNNING
    assert dict(eng.stats.preemptions) == {(Tier.P2, "recompute"): 1}


def test_sglang_priority_threshold_is_a_setting() -> None:
    config = parse_config({"policy": {"sglang-priority": {"preemption_threshold": 5}}})
    p0, eng = _seat_contest(Tier.P1, config)
    assert p0.status is RequestStatus.RUNNING and eng.stats.num_preemptions() == 1


def test_sglang_priority_preempts_nobody_when_the_victims_cannot_free_enough() -> None:
    eng = make_engine("sglang-priority", blocks=100)
    p1 = make_request(num_prompt=16 * 60 - 1, max_tokens=30, tier=Tier.P1)
    p3 = make_request(num_prompt=16 * 20 - 1, max_tokens=30, tier=Tier.P3)
    start(eng, p1, p3)  # 80 blocks held; only the P3 (20) is past the threshold for a P0
    p0 = make_request(num_prompt=16 * 45, max_tokens=4, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)  # needs 46 > 20 free + 20 from the P3
    eng.step()
    assert p3.status is RequestStatus.RUNNING and eng.stats.num_preemptions() == 0
    run(eng)


# ---- fcfs --------------------------------------------------------------------------------


def _fcfs_timeline(tiers: list[Tier]) -> list[tuple[float | None, ...]]:
    """A mixed, memory-short workload with swaps, recomputes and long prompts under fcfs."""
    eng = make_engine(
        "fcfs",
        blocks=120,
        max_num_batched_tokens=256,
        max_num_seqs=6,
        long_prompt_tokens=300,
        long_prompt_chunk_tokens=64,
        swap_factor=1e9,
    )
    rng = random.Random(7)
    reqs = []
    for i, tier in enumerate(tiers):
        req = make_request(
            num_prompt=rng.randint(20, 600),
            max_tokens=rng.randint(5, 120),
            tier=tier,
            arrival=i * 0.02,
            request_id=f"r{i}",
        )
        reqs.append(req)
    pending = list(reqs)
    while pending or eng.has_unfinished():
        while pending and pending[0].arrival_time <= eng.clock.now():
            eng.add_request(pending.pop(0))
        if eng.has_unfinished():
            eng.step()
        else:
            eng.clock.elapse(pending[0].arrival_time - eng.clock.now())
    assert eng.stats.num_preemptions() > 0, "the workload must exercise preemption"
    assert any(k[1] == "swap" for k in eng.stats.preemptions), "the workload must exercise swap"
    return [(r.admitted_time, r.first_token_time, r.finish_time, float(r.num_preemptions)) for r in reqs]


def test_fcfs_ignores_tiers_entirely() -> None:
    rng = random.Random(3)
    tiers = [rng.choice(ALL_TIERS) for _ in range(80)]
    relabelled = [Tier((t + 1 + rng.randrange(3)) % len(ALL_TIERS)) for t in tiers]  # every label changed
    assert all(a != b for a, b in zip(tiers, relabelled, strict=True))
    assert _fcfs_timeline(tiers) == _fcfs_timeline(relabelled)


# ---- article -----------------------------------------------------------------------------


def test_article_p0_reclaims_from_p3_then_p2_but_never_from_p1() -> None:
    eng = make_engine("article", blocks=100)
    p1 = make_request(num_prompt=16 * 45 - 1, max_tokens=50, tier=Tier.P1)
    p2 = make_request(num_prompt=16 * 20 - 1, max_tokens=50, tier=Tier.P2)
    p3 = make_request(num_prompt=16 * 20 - 1, max_tokens=50, tier=Tier.P3)
    start(eng, p1, p2, p3)  # 85 held, P0's floor of 15 free
    p0 = make_request(num_prompt=16 * 38, max_tokens=3, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)  # needs 39: the P3 and the P2 must both go
    eng.step()
    assert p0.status is RequestStatus.RUNNING and p1.status is RequestStatus.RUNNING
    preempted = (RequestStatus.WAITING, RequestStatus.SWAPPED)
    assert p2.status in preempted and p3.status in preempted
    assert eng.stats.num_preemptions() == 2
    run(eng)


def test_article_p0_waits_rather_than_preempt_p1() -> None:
    eng = make_engine("article", blocks=100)
    p1 = make_request(num_prompt=16 * 65 - 1, max_tokens=50, tier=Tier.P1)
    p2 = make_request(num_prompt=16 * 10 - 1, max_tokens=50, tier=Tier.P2)
    p3 = make_request(num_prompt=16 * 10 - 1, max_tokens=50, tier=Tier.P3)
    start(eng, p1, p2, p3)  # 85 held, P0's floor of 15 free
    p0 = make_request(num_prompt=16 * 38, max_tokens=3, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)  # needs 39: P3 and P2 free only 20 more, and P1 is never a victim
    eng.step()
    assert p0.status is RequestStatus.WAITING and p1.status is RequestStatus.RUNNING
    assert eng.stats.num_preemptions() == 0
    run(eng)


def test_article_ages_a_waiting_request_one_level_per_threshold() -> None:
    from tierserve.scheduling.article import ArticlePolicy

    policy = ArticlePolicy(EngineConfig())
    p3 = make_request(tier=Tier.P3, arrival=0.0)
    p1 = make_request(tier=Tier.P1, arrival=0.0)
    # P3: 5 s to P2, 15 s more to P1, 30 s more to P0; P1: 30 s to P0.
    assert [policy.level(p3, t) for t in (4.0, 6.0, 21.0, 51.0)] == [Tier.P3, Tier.P2, Tier.P1, Tier.P0]
    assert [policy.level(p1, t) for t in (29.0, 31.0)] == [Tier.P1, Tier.P0]


def test_article_evaluates_aging_while_requests_wait() -> None:
    from tierserve.scheduling.article import ArticlePolicy

    policy = ArticlePolicy(EngineConfig())
    old_p3 = make_request(tier=Tier.P3, arrival=0.0)
    policy.add(old_p3, 0.0)
    for i in range(20):
        policy.add(make_request(tier=Tier.P2, arrival=0.1 + i * 1e-3), 0.1)
    assert policy.peek(1.0) is not old_p3, "P3 is best effort while P2 waits"
    served_before_p3 = 0
    while policy.peek(6.0) is not old_p3:  # waited 6 s > 5 s: now served as P2, in fair order
        policy.pop(6.0)
        served_before_p3 += 1
    assert served_before_p3 < 20
