"""Hybrid's mechanisms, each pinned by a test that fails when the mechanism is removed."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.conftest import make_request
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, SchedulerConfig, parse_config
from tierserve.engine import Engine
from tierserve.executors.null import NullExecutor
from tierserve.executors.sim.executor import SimExecutor
from tierserve.request import EventKind, FinishReason, Request, RequestStatus, SamplingParams
from tierserve.scheduling.hybrid import P0_FLOOR_SHARE
from tierserve.scheduling.hybrid_step import SHAPING_WINDOW
from tierserve.scheduling.step import StepBudget
from tierserve.tiers import Tier


def engine(
    blocks: int = 256,
    host: int = 256,
    hybrid: dict[str, Any] | None = None,
    policy: str = "hybrid",
    step_s: float = 0.01,
    **sched: Any,
) -> Engine:
    base = parse_config({"policy": {"hybrid": hybrid or {}}})
    config = EngineConfig(
        scheduler=SchedulerConfig(**sched), tiers=base.tiers, policy_options=base.policy_options
    )
    executor = NullExecutor(num_device_blocks=blocks, num_host_blocks=host, block_size=16, step_s=step_s)
    return Engine(config, policy, executor, VirtualClock())


def run(eng: Engine, limit: int = 100_000) -> None:
    for _ in range(limit):
        if not eng.has_unfinished():
            return
        eng.step()
        eng.memory.check_integrity()
    raise AssertionError("engine did not finish")


def p0_prefill_steps(eng: Engine, num_prompt: int) -> list[bool]:
    """Three P1-P2 requests decode; a P0 prompt of `num_prompt` tokens arrives. For each
    step until its first token: whether the step carried P0 work only."""
    others = [make_request(num_prompt=20, max_tokens=400, tier=t) for t in (Tier.P1, Tier.P2, Tier.P2)]
    for r in others:
        eng.add_request(r)
    eng.step()
    eng.step()
    p0 = make_request(num_prompt=num_prompt, max_tokens=2, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    seen = len(executor.batches)
    while p0.first_token_time is None:
        eng.step()
    return [all(s.request.tier is Tier.P0 for s in b.seqs) for b in executor.batches[seen:]]


def test_p0_solo_prefill_runs_a_p0_prompt_at_risk_in_p0_only_steps_at_most_half_the_time() -> None:
    # 16 chunks of 64 tokens at about 0.05 s a step: sharing its steps, the prompt would
    # take 0.8 s, past P0's 0.5 s target.
    eng = engine(blocks=4000, max_num_batched_tokens=64, step_s=0.05)  # p0_solo_prefill is the default
    solo = p0_prefill_steps(eng, num_prompt=1000)
    assert solo[0] and solo[1], "P0's first prefill steps carry no other tier's work"
    window = SHAPING_WINDOW
    for start in range(len(solo) - window + 1):
        assert sum(solo[start : start + window]) <= window // 2, "the others run in half of any window"
    assert not all(solo), "the other tiers' decodes still ran while P0 prefilled"


def test_a_p0_prompt_with_time_to_spare_shares_its_steps() -> None:
    # 4 chunks at about 0.01 s a step: 0.04 s shared, far inside the 0.5 s target.
    solo = p0_prefill_steps(engine(blocks=4000, max_num_batched_tokens=64), num_prompt=250)
    assert solo and not any(solo), "a P0 prompt in no danger leaves the others' decodes in its steps"
    # Always solo (the share at 0), the same prompt runs alone.
    always = engine(blocks=4000, max_num_batched_tokens=64, hybrid={"p0_solo_share": 0.0})
    assert p0_prefill_steps(always, num_prompt=250)[0]


def test_a_p0_prompt_that_waited_runs_solo() -> None:
    # The same short prompt (about 0.04 s of shared steps), but it has waited most of its
    # 0.5 s target already (a long step ran when it arrived): its wait counts, so it
    # prefills alone.
    eng = engine(blocks=4000, max_num_batched_tokens=64)
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    others = [make_request(num_prompt=20, max_tokens=400, tier=Tier.P2) for _ in range(3)]
    for r in others:
        eng.add_request(r)
    eng.step()
    p0 = make_request(num_prompt=250, max_tokens=2, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    clock = eng.clock
    assert isinstance(clock, VirtualClock)
    clock.elapse(0.47)  # as if the step in flight had taken 0.47 s
    seen = len(executor.batches)
    eng.step()
    assert all(s.request.tier is Tier.P0 for s in executor.batches[seen].seqs)


def test_p0_solo_prefill_off_keeps_other_decodes_in_p0_steps() -> None:
    eng = engine(blocks=4000, max_num_batched_tokens=64, hybrid={"p0_solo_prefill": False})
    other = make_request(num_prompt=20, max_tokens=400, tier=Tier.P2)
    eng.add_request(other)
    eng.step()
    p0 = make_request(num_prompt=200, max_tokens=2, tier=Tier.P0)
    eng.add_request(p0)
    eng.step()
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    assert {s.request.tier for s in executor.batches[-1].seqs} == {Tier.P0, Tier.P2}


def p3_in_steps_beside_a_queue(
    waited_s: float, hybrid: dict[str, Any] | None = None, tier: Tier = Tier.P1
) -> tuple[list[bool], list[bool], Request]:
    """Two P3 decoders and a long P3 prompt (chunked 1,024 tokens a step) run; P1 prompts
    arrive faster than a step's 4,096 tokens take them, so every step prefills P1 and some
    wait (for tokens, not seats: a P1 request waiting for a seat would take a P3's). Each
    P1 request (or of `tier`) has waited `waited_s` when it is added. For each step: whether it carried
    the long P3 prompt's chunk, whether it carried a P3 decode; and that prompt."""
    eng = engine(
        blocks=8000, max_num_batched_tokens=4096, max_num_seqs=64, long_prompt_tokens=2000,
        long_prompt_chunk_tokens=1024, hybrid=hybrid,
    )  # fmt: skip
    background = [make_request(num_prompt=16, max_tokens=1000, tier=Tier.P3) for _ in range(2)]
    long_p3 = make_request(num_prompt=3000, max_tokens=1, tier=Tier.P3)
    for r in (*background, long_p3):
        eng.add_request(r)
    eng.step()  # the P3 prompts start: from now on the two decode
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    seen = len(executor.batches)
    for _ in range(40):  # a stream of P1 prompts: every step prefills P1, and some wait
        arrival = eng.clock.now() - waited_s
        for _ in range(4):
            eng.add_request(make_request(num_prompt=1500, max_tokens=1, tier=tier, arrival=arrival))
        eng.step()
        eng.memory.check_integrity()
    steps = executor.batches[seen:]
    p3_prefill = [any(s.request is long_p3 for s in b.prefills) for b in steps]
    p3_decode = [any(s.request in background for s in b.decodes) for b in steps]
    return p3_prefill, p3_decode, long_p3


@pytest.mark.parametrize(
    ("waited_s", "share"),
    [
        (0.0, 0.0),  # the default: any waiting P1 request
        (2.0, 0.25),  # 2 s is over a quarter of P1's 5 s target: a queue
    ],
)
def test_p3_yields_its_prompt_chunks_and_some_decodes_to_waiting_p1(waited_s: float, share: float) -> None:
    hybrid = {"p3_yield_wait_share": share}
    p3_prefill, p3_decode, long_p3 = p3_in_steps_beside_a_queue(waited_s, hybrid)
    assert not p3_prefill[0], "the long P3 prompt yields to the P1 prompt of the same step"
    assert long_p3.first_token_time is not None, "it still runs: in half of the steps at least"
    window = SHAPING_WINDOW
    for start in range(len(p3_decode) - window + 1):
        assert sum(p3_decode[start : start + window]) >= window - window // 4, "P3 decodes in 3/4 of steps"
    assert not all(p3_decode), "P3 decodes yielded to P1 prefills some of the time"


def test_with_a_wait_share_p3_does_not_yield_to_p1_requests_that_have_only_just_arrived() -> None:
    # The same stream, each P1 request queued for 0.5 s only (a tenth of its target), with
    # `p3_yield_wait_share` at a quarter: the next steps admit them anyway.
    p3_prefill, p3_decode, _ = p3_in_steps_beside_a_queue(0.5, {"p3_yield_wait_share": 0.25})
    assert p3_prefill[0], "the long P3 prompt keeps its chunk"
    assert all(p3_decode), "P3 decodes in every step"


def test_with_a_wait_share_p3_still_yields_to_any_waiting_p0() -> None:
    # A stream of P0 prompts that have only just arrived: unlike P1's, P0's wait counts at
    # any length. (P0-only steps off, so that P3's place is decided by its yields alone;
    # P3's prompt chunks already make room for waiting P0 prompts, its decodes do not.)
    hybrid = {"p3_yield_wait_share": 0.25, "p0_solo_prefill": False}
    _, p3_decode, _ = p3_in_steps_beside_a_queue(0.0, hybrid, tier=Tier.P0)
    assert not all(p3_decode), "P3 decodes yielded to the waiting P0 prompts some of the time"


@pytest.mark.parametrize(
    ("policy", "hybrid"),
    [
        ("hybrid", {}),  # yields on, but nobody waits: P3's work delays no one
        ("hybrid", {"p3_yields": False}),
        ("vllm-priority", {}),
    ],
)
def test_p3_stays_in_the_step_when_nothing_waits_yields_off_or_another_policy(
    policy: str, hybrid: dict[str, Any]
) -> None:
    eng = engine(blocks=8000, max_num_batched_tokens=4096, hybrid=hybrid, policy=policy)
    p3 = make_request(num_prompt=16, max_tokens=50, tier=Tier.P3)
    eng.add_request(p3)
    eng.step()
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    for _ in range(10):  # one short P1 prompt a step: admitted at once, nobody waits
        eng.add_request(make_request(num_prompt=32, max_tokens=1, tier=Tier.P1))
        eng.step()
        assert any(s.request is p3 for s in executor.batches[-1].decodes)


@pytest.mark.parametrize("likely_s", [0.0, 1000.0])
def test_other_chunks_stay_small_while_a_p0_is_likely(likely_s: float) -> None:
    eng = engine(
        blocks=8000, max_num_batched_tokens=4096, hybrid={"p0_step_tokens": 64, "p0_likely_s": likely_s}
    )
    p0 = make_request(num_prompt=16, max_tokens=1, tier=Tier.P0)
    eng.add_request(p0)
    run(eng)
    p1 = make_request(num_prompt=1000, max_tokens=1, tier=Tier.P1)
    eng.add_request(p1)
    eng.step()
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    (chunk,) = executor.batches[-1].prefills
    assert chunk.num_tokens == (64 if likely_s else 1000)


def test_a_capped_step_admits_no_prompt_it_cannot_start() -> None:
    # While a P0 is likely the other tiers' prefill shares 64 tokens a step. A request
    # admitted beyond that would hold a seat without running (seats are what decodes need).
    eng = engine(
        blocks=8000, max_num_batched_tokens=4096, hybrid={"p0_step_tokens": 64, "p0_likely_s": 1000.0}
    )
    eng.add_request(make_request(num_prompt=16, max_tokens=1, tier=Tier.P0))
    run(eng)
    for _ in range(10):
        eng.add_request(make_request(num_prompt=40, max_tokens=5, tier=Tier.P1))
    eng.step()
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    scheduled = {s.request for s in executor.batches[-1].seqs}
    assert len(scheduled) == 2, "40 + 24 tokens: two prompts start"
    assert eng.num_running() == 2 and eng.num_waiting(Tier.P1) == 8, "no seat is held without work"
    run(eng)


def _first_p1_chunk(
    likely_s: float, bound_s: float, from_slack: bool = False, p0_prompt: int = 16, x_p0: float = math.inf
) -> int:
    eng = engine(
        blocks=8000,
        max_num_batched_tokens=4096,
        hybrid={
            "step_bound_s": bound_s,
            "p0_step_tokens": 4096,
            "p0_likely_s": likely_s,
            "step_bound_from_slack": from_slack,
            "step_bound_x_p0": x_p0,
        },
    )
    eng.add_request(make_request(num_prompt=p0_prompt, max_tokens=1, tier=Tier.P0))
    run(eng)
    eng.add_request(make_request(num_prompt=3000, max_tokens=1, tier=Tier.P1))
    eng.step()
    executor = eng.executor
    assert isinstance(executor, NullExecutor)
    (chunk,) = executor.batches[-1].prefills
    return chunk.num_tokens


def test_the_step_time_bound_comes_from_the_executors_cost_model() -> None:
    # NullExecutor predicts 0.01 s + 1e-5 s per token: 0.015 s holds 500 tokens, 0.02 s 1,000.
    assert _first_p1_chunk(likely_s=1000.0, bound_s=0.015) == 500
    assert _first_p1_chunk(likely_s=1000.0, bound_s=0.02) == 1000
    assert _first_p1_chunk(likely_s=0.0, bound_s=0.015) == 3000, "no P0 in sight: the full budget"


def test_the_step_bound_widens_to_the_slack_short_p0_prompts_leave() -> None:
    # P0's target is 0.5 s. A 16-token P0 prompt alone is predicted at 0.01016 s, so a
    # step may take 0.48984 s: the whole 3,000-token prompt (0.04 s) fits.
    assert _first_p1_chunk(likely_s=1000.0, bound_s=0.015, from_slack=True) == 3000
    assert _first_p1_chunk(likely_s=1000.0, bound_s=0.015, from_slack=False) == 500
    from tierserve.scheduling.hybrid import HybridOptions
    from tierserve.scheduling.hybrid_step import RECENT_P0_PROMPTS, StepShaper

    def estimate(n: int, context: int) -> float:
        return 0.01 + 1e-5 * (n + context)

    shaper = StepShaper(HybridOptions(step_bound_s=0.015), 100_000, p0_target_s=0.5)
    shaper.p0_admitted(16)
    assert shaper.bound_s(estimate) == pytest.approx(0.5 - 0.01016)
    # A 48,000-token P0 prompt (0.49 s alone) leaves less than `step_bound_s`, which holds
    # until it is no longer among the recent P0 prompts.
    shaper.p0_admitted(48_000)
    assert shaper.bound_s(estimate) == 0.015 and shaper.bound_tokens(estimate) == 500
    for _ in range(RECENT_P0_PROMPTS - 1):
        shaper.p0_admitted(16)
    assert shaper.bound_tokens(estimate) == 500
    shaper.p0_admitted(16)
    assert shaper.bound_tokens(estimate) == HybridOptions().p0_step_tokens  # 48,984 by time


def test_the_step_bound_can_be_held_to_a_multiple_of_p0s_own_step() -> None:
    # A 2,000-token P0 prompt alone: 0.01 + 0.02 = 0.03 s. Half of it, 0.015 s, holds 500
    # tokens, under the 0.05 s `step_bound_s` (4,096) and the slack (0.47 s).
    assert _first_p1_chunk(likely_s=1000.0, bound_s=0.05, p0_prompt=2000) == 3000
    assert _first_p1_chunk(likely_s=1000.0, bound_s=0.05, p0_prompt=2000, x_p0=0.5) == 500
    assert _first_p1_chunk(likely_s=1000.0, bound_s=0.05, from_slack=True, p0_prompt=2000, x_p0=0.5) == 500
    # Below one step's fixed cost the other tiers keep MIN_OTHER_PREFILL_TOKENS.
    from tierserve.scheduling.hybrid_step import MIN_OTHER_PREFILL_TOKENS

    chunk = _first_p1_chunk(likely_s=1000.0, bound_s=0.05, p0_prompt=2000, x_p0=0.1)
    assert chunk == MIN_OTHER_PREFILL_TOKENS


def test_prefill_cap_answers_for_steps_built_elsewhere() -> None:
    """The vLLM plug-in's question: the same bound, asked with counts, not a StepBudget."""
    from tierserve.scheduling.hybrid import HybridOptions
    from tierserve.scheduling.hybrid_step import MIN_OTHER_PREFILL_TOKENS, StepShaper

    def estimate(n: int, context: int) -> float:
        return 0.00205 + 2e-5 * n

    options = HybridOptions(step_bound_x_p0=2.0, p0_likely_s=10.0)
    shaper = StepShaper(options, 512, p0_target_s=0.5)
    assert shaper.prefill_cap(0, False, 8, now=0.0, estimate_s=estimate) is None, "no P0 seen"
    shaper.last_p0_arrival = 0.0
    shaper.p0_admitted(48)  # alone 0.00301 s; twice that holds 198 tokens
    assert shaper.prefill_cap(0, False, 8, now=1.0, estimate_s=estimate) == 198 - 8
    assert shaper.prefill_cap(0, False, 8, now=20.0, estimate_s=estimate) is None, "P0 long gone"
    assert shaper.prefill_cap(1, False, 8, now=20.0, estimate_s=estimate) == 190, "a P0 waits"
    assert shaper.prefill_cap(0, True, 8, now=20.0, estimate_s=estimate) == 190, "a P0 prefills"
    assert shaper.prefill_cap(0, True, 190, now=1.0, estimate_s=estimate) == MIN_OTHER_PREFILL_TOKENS

    def slower(n: int, context: int) -> float:
        return 0.0011 + 4e-5 * n  # a new cost model: the bound is found again

    assert shaper.prefill_cap(0, True, 0, now=1.0, estimate_s=slower) == 123
    # Without a cost model only the token limits bound the step.
    assert shaper.prefill_cap(0, True, 0, now=1.0, estimate_s=None) == 512


def test_p0_takes_a_seat_from_a_lower_tier() -> None:
    eng = engine(blocks=2000, max_num_seqs=2, hybrid={"p0_likely_s": 0.0})
    lows = [make_request(num_prompt=32, max_tokens=500, tier=t) for t in (Tier.P2, Tier.P3)]
    for r in lows:
        eng.add_request(r)
    eng.step()
    p0 = make_request(num_prompt=32, max_tokens=2, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    eng.step()
    assert p0.status is RequestStatus.RUNNING, "P0 waited for a seat held by a lower tier"
    assert lows[1].status is not RequestStatus.RUNNING and lows[0].status is RequestStatus.RUNNING
    assert eng.num_running() == 2
    run(eng)


def test_p1_does_not_take_seats_before_it_is_in_danger() -> None:
    eng = engine(blocks=2000, max_num_seqs=1, hybrid={"p0_likely_s": 0.0})
    low = make_request(num_prompt=32, max_tokens=50, tier=Tier.P3)
    eng.add_request(low)
    eng.step()
    p1 = make_request(num_prompt=32, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(p1)
    eng.step()
    assert p1.status is RequestStatus.WAITING and eng.stats.num_preemptions() == 0
    run(eng)


@pytest.mark.parametrize("holder", [Tier.P3, Tier.P2])
def test_p1_in_danger_takes_the_seat_of_p3_not_of_p2(holder: Tier) -> None:
    # One seat. A P1 request that has waited over half its 5 s target (and can still meet
    # it) makes P3 step aside: it takes a P3's seat, never a P2's.
    eng = engine(blocks=2000, max_num_seqs=1, hybrid={"p0_likely_s": 0.0})
    low = make_request(num_prompt=32, max_tokens=50, tier=holder)
    eng.add_request(low)
    eng.step()
    p1 = make_request(num_prompt=32, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now() - 3.0)
    eng.add_request(p1)
    eng.step()
    if holder is Tier.P3:
        assert p1.status is RequestStatus.RUNNING and low.status is not RequestStatus.RUNNING
        assert eng.stats.num_preemptions() == 1
    else:
        assert p1.status is RequestStatus.WAITING and eng.stats.num_preemptions() == 0
    run(eng)
    assert low.finish_reason is FinishReason.LENGTH and p1.finish_reason is FinishReason.LENGTH


def test_a_swapped_p3_stays_out_while_p1_is_in_danger() -> None:
    # The P3 request swaps out for a P1 in danger; with more P1 requests in danger behind
    # it, the seat goes to them, and P3 comes back only when none is.
    eng = engine(blocks=2000, max_num_seqs=1, hybrid={"p0_likely_s": 0.0}, swap_factor=100.0)
    low = make_request(num_prompt=32, max_tokens=50, tier=Tier.P3)
    eng.add_request(low)
    eng.step()
    now = eng.clock.now()
    p1s = [make_request(num_prompt=32, max_tokens=2, tier=Tier.P1, arrival=now - 3.0) for _ in range(3)]
    for r in p1s:
        eng.add_request(r)
    order: list[object] = []
    while eng.has_unfinished():
        eng.step()
        eng.memory.check_integrity()
        holder = eng.lifecycle.running[0] if eng.lifecycle.running else None
        if holder is not None and (not order or order[-1] is not holder):
            order.append(holder)
    assert eng.stats.preemptions[(Tier.P3, "swap")] == 1
    assert order == [*p1s, low], "every P1 in danger ran before the swapped P3 came back"


def _overloaded(shed_after_s: float, with_p1_backlog: bool) -> tuple[Engine, list[Any]]:
    eng = engine(blocks=2000, max_num_seqs=1, hybrid={"p3_shed_after_s": shed_after_s, "p0_likely_s": 0.0})
    eng.add_request(make_request(num_prompt=32, max_tokens=2000, tier=Tier.P1))  # holds the one seat
    eng.step()
    p3s = [make_request(num_prompt=32, max_tokens=4, tier=Tier.P3, arrival=eng.clock.now()) for _ in range(3)]
    for r in p3s:
        eng.add_request(r)
    if with_p1_backlog:
        eng.add_request(make_request(num_prompt=32, max_tokens=4, tier=Tier.P1, arrival=eng.clock.now()))
    outputs = []
    while eng.clock.now() < 2 * shed_after_s + 1:
        outputs.extend(eng.step())
    return eng, [o.request for o in outputs if o.finished]


def test_p3_is_shed_with_a_reason_when_it_waits_too_long_behind_p1() -> None:
    eng, ended = _overloaded(shed_after_s=2.0, with_p1_backlog=True)
    shed = [r for r in ended if r.tier == Tier.P3]
    assert len(shed) == 3 and eng.stats.num_shed[Tier.P3] == 3
    for r in shed:
        assert r.status is RequestStatus.SHED and r.finish_reason is FinishReason.SHED
        assert "overload" in r.reject_reason and r.events[-1].kind is EventKind.SHED
        assert r.finish_time is not None and r.finish_time - r.arrival_time >= 2.0
    eng.memory.check_integrity()  # raises KVIntegrityError on a broken invariant


def test_p3_is_not_shed_when_nothing_more_urgent_waits() -> None:
    eng, ended = _overloaded(shed_after_s=2.0, with_p1_backlog=False)
    assert not ended and eng.stats.num_shed[Tier.P3] == 0
    assert eng.num_waiting(Tier.P3) == 3


@pytest.mark.parametrize(("swap_block_s", "expected"), [(1.4e-4, "swap"), (1.6e-4, "recompute")])
def test_each_victim_is_preempted_by_the_cheaper_of_swap_and_recompute(
    swap_block_s: float, expected: str
) -> None:
    # 70 blocks of P3: prefill again 0.01 + 1,119e-5 s = 21.2 ms; swap out and back in
    # 2 x 70 x swap_block_s = 19.6 ms (cheaper) or 22.4 ms (dearer).
    executor = NullExecutor(
        num_device_blocks=100, num_host_blocks=200, block_size=16, swap_block_s=swap_block_s
    )
    eng = Engine(EngineConfig(), "hybrid", executor, VirtualClock())
    p3 = make_request(num_prompt=16 * 70 - 1, max_tokens=50, tier=Tier.P3)
    eng.add_request(p3)
    eng.step()
    eng.add_request(make_request(num_prompt=16 * 35 - 1, max_tokens=3, tier=Tier.P0, arrival=eng.clock.now()))
    eng.step()
    assert dict(eng.stats.preemptions) == {(Tier.P3, expected): 1}
    run(eng)


def test_the_step_bound_never_stops_the_other_tiers() -> None:
    # A bound below the fixed cost of any step (0.01 s here) still leaves the others a chunk.
    from tierserve.scheduling.hybrid_step import MIN_OTHER_PREFILL_TOKENS

    assert _first_p1_chunk(likely_s=1000.0, bound_s=0.001) == MIN_OTHER_PREFILL_TOKENS


def test_a_short_p0_prompt_goes_ahead_of_a_long_p0_prefill() -> None:
    eng = engine(blocks=4000, max_num_batched_tokens=256)
    long_p0 = make_request(num_prompt=3000, max_tokens=2, tier=Tier.P0)  # 12 steps of 256 tokens
    eng.add_request(long_p0)
    eng.step()
    eng.step()
    short_p0 = make_request(num_prompt=40, max_tokens=2, tier=Tier.P0)
    eng.add_request(short_p0)
    eng.step()
    assert short_p0.first_token_time is not None, "the short prompt waited for the long one's prefill"
    assert long_p0.num_computed_tokens == 3 * 256 - 40, "the long one kept the rest of the step"


def test_a_long_p0_prompt_keeps_moving_behind_shorter_ones() -> None:
    eng = engine(blocks=8000, max_num_batched_tokens=512)
    long_p0 = make_request(num_prompt=4000, max_tokens=2, tier=Tier.P0)
    eng.add_request(long_p0)
    eng.step()
    before = long_p0.num_computed_tokens
    for _ in range(3):  # shorter P0 prompts, more than a step's worth each time
        for _ in range(3):
            eng.add_request(make_request(num_prompt=300, max_tokens=2, tier=Tier.P0))
        eng.step()
    assert long_p0.num_computed_tokens - before >= 3 * 512 * P0_FLOOR_SHARE


def test_a_waiting_p0_prompt_goes_ahead_of_lower_tiers_running_prefills() -> None:
    eng = engine(blocks=4000, max_num_batched_tokens=256)
    p1 = make_request(num_prompt=3000, max_tokens=2, tier=Tier.P1)
    eng.add_request(p1)
    eng.step()
    p0 = make_request(num_prompt=100, max_tokens=2, tier=Tier.P0)
    eng.add_request(p0)
    eng.step()
    assert p0.first_token_time is not None, "P0's prompt waited for a P1 prefill chunk"


def _long_prompt_running(eng: Engine, tier: Tier, num_prompt: int = 3000) -> Request:
    """A prompt of `tier` that has had its first step of prefill."""
    long_prompt = make_request(num_prompt=num_prompt, max_tokens=2, tier=tier, arrival=eng.clock.now())
    eng.add_request(long_prompt)
    eng.step()
    return long_prompt


def _chunk_of_next_step(eng: Engine, req: Request) -> int:
    """The prompt tokens `req` prefills in the next step."""
    before = req.num_computed_tokens
    eng.step()
    return req.num_computed_tokens - before


@pytest.mark.parametrize(("waiting", "running"), [(Tier.P1, Tier.P2), (Tier.P1, Tier.P3), (Tier.P2, Tier.P3)])
def test_a_waiting_request_goes_ahead_of_a_lower_tiers_running_prefill(waiting: Tier, running: Tier) -> None:
    # A lower tier's long prompt runs (12 steps of 2 s: past a quarter of P1's and P2's TTFT
    # targets); a more urgent request arrives: its first chunk goes in the next step,
    # beside the long prompt's, which keeps the rest of the step.
    eng = engine(blocks=4000, max_num_batched_tokens=256, step_s=2.0)
    long_prompt = _long_prompt_running(eng, running)
    urgent = make_request(num_prompt=100, max_tokens=2, tier=waiting, arrival=eng.clock.now())
    eng.add_request(urgent)
    assert _chunk_of_next_step(eng, long_prompt) == 256 - 100
    assert urgent.first_token_time is not None, f"{waiting.name} waited for a {running.name} prefill"
    run(eng)


@pytest.mark.parametrize(("waiting", "running"), [(Tier.P1, Tier.P2), (Tier.P2, Tier.P3)])
def test_no_tokens_are_kept_for_a_head_that_cannot_come_in_as_requests_end(
    waiting: Tier, running: Tier
) -> None:
    # The head needs 100 blocks; the pool has 200, the long prompt takes 150 and the head
    # may not take them (its tier borrows nothing). Short decoders end one by one: kept
    # for at each end, the long prompt lost a whole step every time and the head, waiting
    # for its blocks, came in later (a review's repro: 50 s instead of 38 s for a P2 head).
    eng = engine(blocks=200, max_num_batched_tokens=256, max_num_seqs=16, step_s=2.0)
    for i in range(6):
        eng.add_request(make_request(num_prompt=8, max_tokens=4 + 2 * i, tier=Tier.P1))
    eng.step()
    long_prompt = make_request(num_prompt=16 * 150, max_tokens=2, tier=running)
    eng.add_request(long_prompt)
    eng.step()
    big = make_request(num_prompt=16 * 100, max_tokens=2, tier=waiting, arrival=eng.clock.now())
    eng.add_request(big)
    chunks = []
    while long_prompt.first_token_time is None:
        before = long_prompt.num_computed_tokens
        eng.step()
        chunks.append(long_prompt.num_computed_tokens - before)
    assert big.status is RequestStatus.WAITING
    assert min(chunks[:-1]) >= 256 - 6, chunks  # each step but its last: the step, but the decodes
    run(eng)


def test_no_tokens_are_kept_for_a_head_a_swapped_request_must_come_back_before() -> None:
    # A P1 request is swapped out and a P0 takes its blocks: it cannot come back, and no
    # P1 may be admitted before it does. The P1 head that arrives then cannot come in, so
    # the P3 prompt running keeps its chunk (it lost it, and the head still waited).
    eng = engine(blocks=400, host=400, max_num_batched_tokens=1024, step_s=2.0)
    swapped = make_request(num_prompt=16 * 90 - 1, max_tokens=400, tier=Tier.P1)
    eng.add_request(swapped)
    while swapped.first_token_time is None:
        eng.step()
    long_prompt = _long_prompt_running(eng, Tier.P3, num_prompt=16 * 250)
    eng.scheduler.request_preemption(swapped)
    p0 = make_request(num_prompt=16 * 100 - 1, max_tokens=400, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(p0)
    while p0.first_token_time is None:
        eng.step()
    assert swapped.status is RequestStatus.SWAPPED
    head = make_request(num_prompt=16 * 20, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(head)
    assert _chunk_of_next_step(eng, long_prompt) > 0
    assert head.status is RequestStatus.WAITING and swapped.status is RequestStatus.SWAPPED
    run(eng)


def test_the_tokens_kept_for_a_head_leave_out_its_cached_prefix() -> None:
    # The P1 head's first 240 tokens are cached: it prefills 16, and the P2 prompt keeps 240.
    eng = engine(blocks=4000, max_num_batched_tokens=256, step_s=2.0, enable_prefix_caching=True)
    shared = list(range(1000, 1240))
    eng.add_request(make_request(tokens=[*shared, *[5] * 16], max_tokens=1, tier=Tier.P1))
    run(eng)
    long_prompt = _long_prompt_running(eng, Tier.P2)
    head = make_request(tokens=[*shared, *[9] * 16], max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(head)
    assert _chunk_of_next_step(eng, long_prompt) == 240
    assert head.first_token_time is not None
    run(eng)


def test_while_a_p0_is_likely_the_waiting_request_gets_its_chunk_of_the_capped_share() -> None:
    # P1-P3 share 64 prompt tokens a step while a P0 is likely: the P2 prompt running
    # leaves the P1 head its 40 of them, not only of the step's 4,096.
    # (47 steps of 64 tokens, 0.1 s each: the P1 request would wait past a quarter of its target.)
    eng = engine(
        blocks=8000,
        max_num_batched_tokens=4096,
        hybrid={"p0_step_tokens": 64, "p0_likely_s": 1000.0},
        step_s=0.1,
    )
    eng.add_request(make_request(num_prompt=16, max_tokens=1, tier=Tier.P0))
    run(eng)
    long_prompt = _long_prompt_running(eng, Tier.P2)
    p1 = make_request(num_prompt=40, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(p1)
    assert _chunk_of_next_step(eng, long_prompt) == 64 - 40
    assert p1.first_token_time is not None
    run(eng)


def test_a_deep_chunk_cut_for_the_head_leaves_it_the_capped_share() -> None:
    # P1-P3 share 64 tokens a step while a P0 is likely; a P3 prompt 12,000 tokens deep is
    # charged its chunk at its context. Cut to the share less the head's 20 tokens but kept
    # at the cap's floor, it took the whole share: the P1 found no token in it, pass after
    # pass, until the P3 prompt ended (a review's repro: 91 steps, 2.0 s).
    from tierserve.executors.sim.executor import build_sim_executor

    base = parse_config({"policy": {"hybrid": {"p0_likely_s": 1000.0}}})
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        tiers=base.tiers,
        policy_options=base.policy_options,
    )
    executor = build_sim_executor("llama-3.1-70b", "a100-80gb", 8, block_size=16, num_device_blocks=4000)
    eng = Engine(config, "hybrid", executor, VirtualClock())
    eng.add_request(make_request(num_prompt=20, max_tokens=1, tier=Tier.P0))
    eng.step()
    p3 = make_request(num_prompt=16000, max_tokens=1, tier=Tier.P3, arrival=eng.clock.now())
    eng.add_request(p3)
    while p3.num_computed_tokens < 12000:
        eng.step()
    p1 = make_request(num_prompt=20, max_tokens=1, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(p1)
    eng.step()
    assert p1.first_token_time is not None
    assert p3.status is RequestStatus.RUNNING and p3.first_token_time is None


def test_whether_the_head_could_come_in_is_asked_again_once_the_running_requests_change() -> None:
    # The answer is kept while the running and swapped requests stay as they are, and asked
    # again once they change: kept after a swapped request came back into the last seat,
    # a lower tier's chunk was cut for a head that then had no seat (here a P0 comes in).
    eng = engine(blocks=4000, max_num_batched_tokens=256, max_num_seqs=2)
    eng.add_request(make_request(num_prompt=8, max_tokens=50, tier=Tier.P2))
    eng.step()
    head = make_request(num_prompt=100, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(head)
    step = StepBudget(256, 2)
    first_chunk = eng.scheduler._first_chunk_for(step)
    assert first_chunk(head) == 100
    eng.add_request(make_request(num_prompt=8, max_tokens=50, tier=Tier.P0))
    eng.step()  # the P0 takes the second seat (the P1 head may not take a P0's or a P2's)
    assert eng.num_running() == 2 and head.status is RequestStatus.WAITING
    assert first_chunk(head) is None


@pytest.mark.parametrize("policy", ["vllm-priority", "sglang-priority", "strict"])
def test_running_prefills_keep_the_step_under_other_policies(policy: str) -> None:
    # The other policies prefill their running prompts first (vLLM's and SGLang's order):
    # the test above pins a choice of hybrid's, not of every policy's.
    eng = engine(blocks=4000, max_num_batched_tokens=256, policy=policy, step_s=2.0)
    long_prompt = _long_prompt_running(eng, Tier.P2)
    urgent = make_request(num_prompt=100, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(urgent)
    assert _chunk_of_next_step(eng, long_prompt) == 256 and urgent.first_token_time is None


def test_a_running_lower_tier_prompt_keeps_its_chunk_where_the_wait_behind_it_is_short() -> None:
    # 12 steps of 0.01 s: the P1 request waits 0.12 s, far inside its 5 s target.
    eng = engine(blocks=4000, max_num_batched_tokens=256, step_s=0.01)
    long_prompt = _long_prompt_running(eng, Tier.P2)
    p1 = make_request(num_prompt=100, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(p1)
    assert _chunk_of_next_step(eng, long_prompt) == 256 and p1.first_token_time is None
    run(eng)
    assert p1.first_token_time is not None


def test_a_head_past_its_target_does_not_go_ahead() -> None:
    # It has waited 6 s of P1's 5: going first no longer makes its target, and the P2
    # prompt running keeps its whole step.
    eng = engine(blocks=4000, max_num_batched_tokens=256, step_s=2.0)
    long_prompt = _long_prompt_running(eng, Tier.P2)
    late = make_request(num_prompt=100, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now() - 6.0)
    eng.add_request(late)
    assert _chunk_of_next_step(eng, long_prompt) == 256 and late.first_token_time is None
    run(eng)


def test_a_running_prompt_of_the_same_tier_keeps_its_chunk() -> None:
    eng = engine(blocks=4000, max_num_batched_tokens=256, step_s=2.0)
    first = _long_prompt_running(eng, Tier.P1)
    later = make_request(num_prompt=100, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(later)
    assert _chunk_of_next_step(eng, first) == 256 and later.status is RequestStatus.WAITING


def test_no_tokens_are_kept_for_a_head_without_a_seat() -> None:
    # Both seats are P2's and a P1 request takes only a P3 request's seat (once it has
    # waited a third of its target, from the second step on): the long P2 prompt keeps its
    # whole step.
    eng = engine(blocks=4000, max_num_batched_tokens=256, max_num_seqs=2, step_s=2.0)
    eng.add_request(make_request(num_prompt=8, max_tokens=50, tier=Tier.P2))
    long_prompt = make_request(num_prompt=3000, max_tokens=2, tier=Tier.P2)
    eng.add_request(long_prompt)
    eng.step()
    head = make_request(num_prompt=100, max_tokens=2, tier=Tier.P1, arrival=eng.clock.now())
    eng.add_request(head)
    chunks = []
    for _ in range(3):
        before = long_prompt.num_computed_tokens
        eng.step()
        chunks.append(long_prompt.num_computed_tokens - before)
    assert chunks == [255, 255, 255] and head.status is RequestStatus.WAITING
    run(eng)


def sim_70b_engine(bound_s: float) -> tuple[Engine, SimExecutor]:
    """Hybrid on the simulator's cost model (70B on 8 x A100, vLLM's limits), its step bound
    fixed at `bound_s` and holding at all times."""
    from tierserve.executors.sim.executor import build_sim_executor

    hybrid = {"step_bound_s": bound_s, "p0_likely_s": 1e9, "step_bound_from_slack": False}
    base = parse_config({"policy": {"hybrid": hybrid}})
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
        tiers=base.tiers,
        policy_options=base.policy_options,
    )
    executor = build_sim_executor("llama-3.1-70b", "a100-80gb", 8)
    return Engine(config, "hybrid", executor, VirtualClock()), executor


def test_a_chunk_deep_into_a_long_prompt_is_priced_at_its_context() -> None:
    # On the simulator's cost model (70B on 8 x A100) a chunk's attention reads every
    # cached token before it: under the P0 step bound, the chunks of a long P1 prompt shrink
    # as it goes, so each step stays within the bound instead of growing with the context.
    bound_s = 0.15
    eng, executor = sim_70b_engine(bound_s)
    eng.add_request(make_request(num_prompt=16, max_tokens=1, tier=Tier.P0))  # a P0 is now likely
    run(eng)
    p1 = make_request(num_prompt=60_000, max_tokens=1, tier=Tier.P1)
    eng.add_request(p1)
    chunks: list[tuple[int, int]] = []  # (context, tokens)
    while p1.first_token_time is None:
        context = p1.num_computed_tokens
        eng.step()
        chunks.append((context, p1.num_computed_tokens - context))
    first, deepest = chunks[0][1], chunks[-2][1]
    assert first > 1000 and deepest < first / 2, "chunks deep into the prompt are smaller"
    for context, tokens in chunks[:-1]:
        assert executor.estimate_prefill_s(tokens, context) <= bound_s, "a step outgrew the bound"
    # Priced at an empty context (as before) the last chunks alone would take far longer.
    assert executor.estimate_prefill_s(first, chunks[-2][0]) > 1.5 * bound_s


def test_pricing_at_the_context_never_cuts_a_chunk_below_the_floor() -> None:
    from tierserve.scheduling.step import StepBudget

    def estimate(n: int, context: int) -> float:  # attention over the context dominates
        return 0.01 + 1e-5 * n + 1e-7 * n * context

    step = StepBudget(4096, 256, estimate_s=estimate)
    step.cap_prefill([Tier.P1], 1000, at_least=64)
    fresh = make_request(num_prompt=3000, max_tokens=1, tier=Tier.P1)
    assert step.chunk_for(fresh) == 1000
    deep = make_request(num_prompt=300_000, max_tokens=1, tier=Tier.P1)
    deep.num_computed_tokens = 200_000  # 1e-7 x 200,000 = 0.02 s a token: one fits at most
    assert step.chunk_for(deep) == 64, "the floor keeps a long prompt moving"
    mid = make_request(num_prompt=2_000, max_tokens=1, tier=Tier.P1)
    mid.num_computed_tokens = 200  # 1e-5 + 1e-7 x 200 = 3e-5 s a token: a third of the fresh count
    n = step.chunk_for(mid)
    assert n == 333 and estimate(n, 200) <= estimate(1000, 0) < estimate(n + 1, 200)
    step.add_prefill(mid, n)
    assert 0 <= step.capped_tokens_left <= 10, "it was charged the fresh tokens it costs"


def test_a_p0_head_held_by_its_own_ceiling_does_not_hold_up_the_other_tiers() -> None:
    # 100 blocks of 16: P0 may hold 40. Two running P0s hold 38; the third P0 (7 blocks)
    # must wait for one of them, and the pool has 62 blocks free. Admission stopped at that
    # head, so the P1 behind it waited for a P0 to finish (20 steps) with the memory idle.
    eng = engine(blocks=100)
    p0s = [make_request(num_prompt=290, max_tokens=20, tier=Tier.P0) for _ in range(3)]
    p0s[2] = make_request(num_prompt=100, max_tokens=20, tier=Tier.P0)
    p1 = make_request(num_prompt=50, max_tokens=4, tier=Tier.P1)
    for r in (*p0s, p1):
        assert eng.add_request(r)
    eng.step()
    eng.memory.check_integrity()
    assert p0s[0].status is RequestStatus.RUNNING and p0s[2].status is RequestStatus.WAITING
    assert p1.status is RequestStatus.RUNNING, "P1 waited behind a P0 that only P0 can make room for"
    run(eng)
    assert all(r.finish_reason is FinishReason.LENGTH for r in (*p0s, p1))


def test_a_p1_head_whose_own_tier_fills_the_pool_does_not_hold_up_the_other_tiers() -> None:
    # P1's ceiling is the whole pool: a P1 request of 80 blocks runs, the next P1 needs 30
    # and the pool has 20 free, so only P1's own running request can make room; the small
    # P2 behind it fits and goes in (a review's repro: a change that read a ceiling of the
    # whole pool as no tier's own limit kept it waiting for the P1).
    eng = engine(blocks=100)
    big = make_request(num_prompt=16 * 80 - 1, max_tokens=30, tier=Tier.P1)
    assert eng.add_request(big)
    eng.step()
    p1 = make_request(num_prompt=16 * 30 - 1, max_tokens=3, tier=Tier.P1, arrival=eng.clock.now())
    p2 = make_request(num_prompt=16 * 4 - 1, max_tokens=3, tier=Tier.P2, arrival=eng.clock.now())
    assert eng.add_request(p1) and eng.add_request(p2)
    eng.step()
    assert p1.status is RequestStatus.WAITING and p2.status is RequestStatus.RUNNING
    run(eng)


def test_a_long_p0_chunk_beside_a_shorter_p0_prompt_is_held_to_the_step_bound() -> None:
    # A short P0 prompt that arrives while a long one prefills deep into its context goes
    # first by tokens; its step must not take a long chunk's time too (70B on 8 x A100:
    # 1,900 tokens after 40,000 take far longer than the bound).
    bound_s = 0.15
    eng, executor = sim_70b_engine(bound_s)
    long_p0 = make_request(num_prompt=60_000, max_tokens=1, tier=Tier.P0)
    eng.add_request(long_p0)
    while long_p0.num_computed_tokens < 40_000:
        eng.step()
    short_p0 = make_request(num_prompt=100, max_tokens=1, tier=Tier.P0, arrival=eng.clock.now())
    eng.add_request(short_p0)
    context = long_p0.num_computed_tokens
    eng.step()
    assert short_p0.first_token_time is not None, "the short prompt went first"
    chunk = long_p0.num_computed_tokens - context
    assert chunk > 0, "the long prompt still moved"
    assert executor.estimate_prefill_s(chunk, context) <= bound_s, "the long chunk outgrew the bound"
    assert executor.estimate_prefill_s(2048 - 100, context) > 2 * bound_s  # what it took before
    run(eng)


def _engine_with_p1_decoders(num: int, max_tokens: int) -> tuple[Engine, SimExecutor, list[Request]]:
    """`sim_70b_engine` (step bound 0.15 s) with `num` short P1 requests decoding."""
    eng, executor = sim_70b_engine(0.15)
    p1s = [make_request(num_prompt=64, max_tokens=max_tokens, tier=Tier.P1) for _ in range(num)]
    for req in p1s:
        eng.add_request(req)
    eng.step()  # they decode from here on
    return eng, executor, p1s


def _step_leaving_out(eng: Engine, p1s: list[Request]) -> bool:
    """One step; whether it left the P1 decodes out (a P0-only step)."""
    before = [r.num_tokens for r in p1s]
    eng.step()
    return [r.num_tokens for r in p1s] == before


def _p0_only_steps_until_budget_spent(eng: Engine, p1s: list[Request], long_p0: Request) -> None:
    """Step the long P0 prompt until 40,000 of its tokens are in and P0-only steps (the P1
    decodes left out) fill half of the last SHAPING_WINDOW steps."""
    left_out: list[bool] = []
    for _ in range(1000):
        left_out.append(_step_leaving_out(eng, p1s))
        recent = left_out[-SHAPING_WINDOW:]
        if long_p0.num_computed_tokens >= 40_000 and sum(recent) >= SHAPING_WINDOW // 2:
            return
    raise AssertionError("the long prompt's P0-only steps never filled half the window")


def test_a_p0_prompt_that_meets_its_target_only_alone_gets_its_step_to_itself() -> None:
    # Mooncake's synthetic trace: an 89-token P0 prompt arrived during a 0.44 s chunk of a
    # 50,764-token P0 prompt, then shared its step with that prompt's next chunk and a P1
    # chunk (0.3 s) and missed 0.5 s, where a step of its own (0.02 s) would have made it.
    # The half-the-window budget for P0-only steps was spent on the long prompt.
    eng, executor, p1s = _engine_with_p1_decoders(4, max_tokens=600)
    long_p0 = make_request(num_prompt=60_000, max_tokens=1, tier=Tier.P0, arrival=eng.clock.now() - 0.5)
    eng.add_request(long_p0)
    _p0_only_steps_until_budget_spent(eng, p1s, long_p0)
    waited_s = 0.4  # for the step in flight when it arrived
    short_p0 = make_request(num_prompt=100, max_tokens=1, tier=Tier.P0, arrival=eng.clock.now() - waited_s)
    eng.add_request(short_p0)
    long_before, p1_before = long_p0.num_computed_tokens, [r.num_tokens for r in p1s]
    assert executor.estimate_prefill_s(100, 0) < 0.5 - waited_s, "it can still meet its target alone"
    eng.step()
    assert short_p0.first_token_time is not None
    assert short_p0.first_token_time - short_p0.arrival_time <= 0.5
    assert long_p0.num_computed_tokens == long_before, "the longer P0 prompt sat the step out"
    assert [r.num_tokens for r in p1s] == p1_before, "so did the other tiers' decodes"
    eng.step()
    assert long_p0.num_computed_tokens > long_before, "and moves on after it"
    run(eng)


def test_a_rescued_p0_step_keeps_the_shorter_p0_prompts() -> None:
    # Two P0 prompts that waited 0.3 s for the step in flight: one of 60 tokens makes its
    # target sharing the step, one of 1,500 only alone. The step given to the longer one
    # keeps the shorter one's chunk (it goes first by tokens); an earlier version dropped
    # it, and the shorter one missed too.
    eng, _, _ = _engine_with_p1_decoders(8, max_tokens=200)
    now = eng.clock.now()
    short = make_request(num_prompt=60, max_tokens=1, tier=Tier.P0, arrival=now - 0.3)
    longer = make_request(num_prompt=1500, max_tokens=1, tier=Tier.P0, arrival=now - 0.3)
    eng.add_request(short)
    eng.add_request(longer)
    eng.step()
    assert longer.num_computed_tokens > 0, "the longer one was in the step"
    assert short.first_token_time is not None, "and so was the shorter one"
    assert short.first_token_time - short.arrival_time <= 0.5
    run(eng)


def test_a_p0_request_past_its_first_token_is_not_rescued() -> None:
    # A P0 request preempted by recompute after its first token prefills again: its TTFT
    # is settled, so it gets no P0-only step past the budget (the other tiers' decodes stay).
    from tierserve.scheduling.hybrid import HybridOptions
    from tierserve.scheduling.hybrid_step import StepShaper
    from tierserve.scheduling.step import StepBudget

    def end_step(first_token_time: float | None) -> StepBudget:
        shaper = StepShaper(HybridOptions(), 2048, p0_target_s=0.5)
        for _ in range(SHAPING_WINDOW // 2):
            shaper.solo(True)  # the half-window budget is spent
        p0 = make_request(num_prompt=100, max_tokens=4, tier=Tier.P0, arrival=0.0)
        p0.first_token_time = first_token_time
        decodes = {make_request(tier=Tier.P1): 1 for _ in range(200)}
        # 0.05 s a step plus 1 ms a token: sharing, 0.3 s waited + 0.35 s; alone, + 0.15 s.
        step = StepBudget(
            2048, 256, decodes=decodes, prefills={p0: 100}, estimate_s=lambda n, _: 0.05 + n / 1000
        )
        shaper.end(step, queued=False, now=0.3)
        return step

    assert not end_step(None).decodes, "a P0 prompt still before its first token is rescued"
    assert len(end_step(0.1).decodes) == 200, "one past its first token is not"


def test_rescued_p0_steps_leave_the_other_tiers_one_step_in_eight() -> None:
    # P0 prompts that each meet their target only alone, arriving faster than the GPU can
    # serve them alone: the other tiers are delayed, never stopped.
    eng, _, p1s = _engine_with_p1_decoders(16, max_tokens=400)
    left_out: list[bool] = []
    for _ in range(64):
        eng.add_request(
            make_request(num_prompt=2600, max_tokens=1, tier=Tier.P0, arrival=eng.clock.now() - 0.1)
        )
        left_out.append(_step_leaving_out(eng, p1s))
    assert sum(left_out) >= SHAPING_WINDOW, "P0 took many steps to itself"
    for i in range(len(left_out) - SHAPING_WINDOW + 1):
        assert sum(left_out[i : i + SHAPING_WINDOW]) <= SHAPING_WINDOW - 1, f"steps {i}-{i + 7}"
    run(eng)


def _shared_prefix_engine(config: dict[str, Any], blocks: int, host: int, block_size: int) -> Engine:
    executor = NullExecutor(num_device_blocks=blocks, num_host_blocks=host, block_size=block_size)
    return Engine(parse_config(config), "hybrid", executor, VirtualClock())


def _req(eng: Engine, rid: str, prompt: list[int], max_tokens: int, tier: Tier) -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), tier=tier, arrival_time=eng.clock.now())
    assert eng.add_request(req)
    return req


def _p1_sharing_a_p0_block(
    scheduler: dict[str, int], p0_share: float, blocks: int, p1_tokens: int
) -> tuple[Engine, Request, Request]:
    """An engine where a P0 request ("a") computed a prefix block that a P1 request ("b",
    `p1_tokens` more) shares: once "a" ends the block stays charged to P0 while "b" holds
    it. Returns the engine, "a" (running) and "b"."""
    config = {"scheduler": scheduler, "tiers": {"P0": {"floor": p0_share, "ceiling": p0_share}}}
    eng = _shared_prefix_engine(config, blocks=blocks, host=0, block_size=16)
    shared = list(range(1000, 1016))
    first = _req(eng, "a", [*shared, *range(2000, 2016)], 3, Tier.P0)
    eng.step()
    return eng, first, _req(eng, "b", [*shared, *range(3000, 3000 + p1_tokens)], 2, Tier.P1)


def _until_final(eng: Engine, req: Request) -> None:
    while not req.status.is_final:
        eng.step()


def test_a_p0_prompt_over_its_ceiling_does_not_keep_the_step_from_the_prompt_that_would_free_it() -> None:
    """A prefix block computed by a P0 request stays charged to P0 while a P1 request shares
    it. A P0 prompt that then finds P0 over its ceiling is set aside, but the step's tokens
    were kept for it pass after pass: the P1 prompt, which alone could free the block, never
    prefilled again and the engine stood still (every later step empty)."""
    eng, first, p1 = _p1_sharing_a_p0_block({"max_num_batched_tokens": 64}, 0.25, blocks=40, p1_tokens=300)
    _until_final(eng, first)  # P0 may hold 10 blocks
    late = _req(eng, "d", list(range(4000, 4145)), 1, Tier.P0)  # fits P0's ceiling alone, not now
    run(eng, limit=10_000)
    assert p1.finish_reason is FinishReason.LENGTH and late.finish_reason is FinishReason.LENGTH


def test_p0_set_aside_over_its_ceiling_is_taken_up_again_once_the_prompt_holding_its_blocks_ends() -> None:
    """P0 set aside because its tier is over its ceiling (blocks charged to P0 held by a P1
    prompt) was taken up again only when a running P0 request ended or a P0 came in: once
    the P1 prompt had ended and the P0 prompt could come in, nothing was kept for it, and a
    long P2 prompt's chunks took every step until that prompt was in."""
    eng, first, p1 = _p1_sharing_a_p0_block({"max_num_batched_tokens": 64}, 0.025, blocks=400, p1_tokens=300)
    _until_final(eng, first)  # P0 may hold 10 blocks
    long_p2 = _req(eng, "c", list(range(5000, 8000)), 2, Tier.P2)  # 47 chunks of 64 tokens
    late = _req(eng, "d", list(range(4000, 4145)), 1, Tier.P0)  # fits P0's ceiling alone, not now
    while not p1.status.is_final:
        eng.step()
    assert late.first_token_time is None and long_p2.first_token_time is None
    freed_s = eng.clock.now()
    run(eng, limit=10_000)
    assert late.first_token_time is not None and long_p2.first_token_time is not None
    # Its 145 tokens take 3 steps of 64 once it may come in, not the P2 prompt's 47.
    assert late.first_token_time - freed_s < 6 * 0.01 and late.first_token_time < long_p2.first_token_time


def test_with_every_seat_taken_p0_over_its_ceiling_is_still_taken_up_once_its_blocks_are_freed() -> None:
    """With three seats the lower tiers admitted after the P0 prompt was refused at its
    ceiling took the last seat; the check then found the P1 holder of P0's block as the
    seat's victim, read the P0 prompt as one that could come in, and the lift never came:
    0.51 s after the holder ended, as with no lift at all (a review)."""
    limits = {"max_num_batched_tokens": 64, "max_num_seqs": 3}
    eng, first, p1 = _p1_sharing_a_p0_block(limits, 0.025, blocks=400, p1_tokens=600)
    p3 = _req(eng, "x", list(range(9000, 9020)), 400, Tier.P3)
    _until_final(eng, first)
    long_p2 = _req(eng, "c", list(range(5000, 8000)), 2, Tier.P2)
    late = _req(eng, "d", list(range(4000, 4145)), 1, Tier.P0)
    while not p1.status.is_final:
        eng.step()
    freed_s = eng.clock.now()
    run(eng, limit=100_000)
    assert late.first_token_time is not None and long_p2.first_token_time is not None
    assert late.first_token_time - freed_s < 6 * 0.01 and late.first_token_time < long_p2.first_token_time
    assert p3.num_preemptions == 0


def test_no_seat_is_taken_for_a_p0_prompt_its_ceiling_keeps_out() -> None:
    """Every seat taken and P0 over its ceiling by a P1 prompt's hold on a P0-charged block:
    a P3 request's seat was taken for the P0 prompt, which admission then set aside at its
    ceiling, pass after pass (the P3 request recomputed 91 times, the P1 prompt's 3,000
    tokens taking 182 steps instead of 92; a review)."""
    limits = {"max_num_batched_tokens": 64, "max_num_seqs": 3}
    limits |= {"long_prompt_tokens": 64, "long_prompt_chunk_tokens": 32}
    eng, first, p1 = _p1_sharing_a_p0_block(limits, 0.025, blocks=400, p1_tokens=3000)
    p3 = _req(eng, "x", list(range(9000, 9004)), 5000, Tier.P3)
    _until_final(eng, first)
    late = _req(eng, "d", list(range(4000, 4145)), 1, Tier.P0)  # over P0's ceiling while b runs
    eng.step()
    eng.step()
    _req(eng, "z", list(range(9500, 9504)), 5000, Tier.P2)  # takes the last seat
    steps = 0
    while not p1.status.is_final:
        eng.step()
        steps += 1
    assert p3.num_preemptions == 0
    assert steps < 100  # its 2,984 tokens left in chunks of 32, about one a step
    run(eng, limit=100_000)
    assert late.finish_reason is FinishReason.LENGTH


def test_a_p0_request_swapped_out_over_its_ceiling_comes_back_once_the_sharing_prompts_end() -> None:
    """The same with a swapped-out P0 request: it cannot come back while P1 prompts hold
    blocks charged to P0, nothing is admitted ahead of it, and the tokens kept for a waiting
    P0 prompt starved those P1 prompts: the engine stood still."""
    config = {
        "scheduler": {"max_num_batched_tokens": 16, "long_prompt_tokens": 100, "long_prompt_chunk_tokens": 4},
        "tiers": {"P0": {"floor": 0.02, "ceiling": 0.04}},  # of 1000 blocks: P0 may hold 40
    }
    eng = _shared_prefix_engine(config, blocks=1000, host=1000, block_size=1)
    shared, shared2 = list(range(1000, 1010)), list(range(2000, 2010))
    _req(eng, "a", [*shared, 1], 3, Tier.P0)
    swapped = _req(eng, "c", [*shared2, *range(3000, 3010)], 20, Tier.P0)  # 40 blocks at its end
    eng.step()
    eng.step()
    p1s = [
        _req(eng, "b1", [*shared, *range(4000, 4300)], 4, Tier.P1),
        _req(eng, "b2", [*shared2, *range(5000, 5300)], 4, Tier.P1),
    ]
    while swapped.status is not RequestStatus.SWAPPED:
        eng.step()
        assert eng.clock.now() < 100
    late = _req(eng, "d", list(range(6000, 6030)), 4, Tier.P0)
    run(eng, limit=10_000)
    assert all(r.finish_reason is FinishReason.LENGTH for r in [*p1s, swapped, late])


def test_a_p3_request_preempted_after_running_is_shed_only_once_it_has_waited_in_the_queue() -> None:
    """The shedding rule measured a P3 request's wait from its arrival: one that had decoded
    for 13 s lost its seat to P1 requests (by recompute) and was shed at once, 1,366 tokens
    thrown away, for having "waited over 10 s"."""
    config = parse_config({"scheduler": {"max_num_seqs": 1}, "policy": {"hybrid": {"p3_shed_after_s": 10.0}}})
    executor = NullExecutor(num_device_blocks=1000, num_host_blocks=0, step_s=0.01)
    eng = Engine(config, "hybrid", executor, VirtualClock())
    background = Request("bg", list(range(100)), SamplingParams(max_tokens=5000), tier=Tier.P3)
    assert eng.add_request(background)
    while eng.clock.now() < 12.0:
        eng.step()
    assert background.status is RequestStatus.RUNNING  # it ran, it did not wait
    for i in range(2):
        prompt = list(range(1000 + 50 * i, 1050 + 50 * i))
        sampling, now = SamplingParams(max_tokens=400), eng.clock.now()
        eng.add_request(Request(f"p1-{i}", prompt, sampling, tier=Tier.P1, arrival_time=now))
    while eng.clock.now() < 16.0:
        eng.step()
    assert background.num_preemptions == 1 and background.status is RequestStatus.WAITING
    run(eng)
    assert background.finish_reason is FinishReason.LENGTH


def test_a_p0_prompt_waiting_on_another_p0_requests_blocks_comes_in_once_they_are_freed() -> None:
    """After a pass that kept tokens for a P0 prompt and could not admit it (P0 at its
    ceiling, held by a running P0 request), none were kept again until a P0 request came
    in: once the running one ended, a long P1 prompt's chunks took every step and the P0
    prompt waited for that whole prefill (first token 1.0 s after the blocks were free)."""
    config = {"scheduler": {"max_num_batched_tokens": 64}, "tiers": {"P0": {"floor": 0.25, "ceiling": 0.25}}}
    executor = NullExecutor(num_device_blocks=1000, num_host_blocks=0, block_size=16, step_s=0.01)
    eng = Engine(parse_config(config), "hybrid", executor, VirtualClock())
    holder = _req(eng, "a", list(range(1000, 4600)), 40, Tier.P0)  # most of P0's 250 blocks
    while holder.first_token_time is None:
        eng.step()
    long_p1 = _req(eng, "b", list(range(10000, 18000)), 2, Tier.P1)  # 125 chunks of 64 tokens
    eng.step()
    waiting = _req(eng, "c", list(range(20000, 20600)), 2, Tier.P0)  # over P0's ceiling until a ends
    run(eng)
    assert holder.finish_time is not None and waiting.first_token_time is not None
    assert waiting.first_token_time - holder.finish_time < 0.25
    assert long_p1.first_token_time is not None and waiting.first_token_time < long_p1.first_token_time - 0.5


def test_a_p0_prompt_waiting_behind_another_p0_prefill_is_not_set_aside_as_stuck() -> None:
    """A pass that kept tokens for a waiting P0 prompt and admitted none set P0 aside, as
    if the prompt could not come in, even where a shorter P0 prompt running ahead of it had
    taken the step's tokens. Nothing was kept for it then until that request ended: a
    lower tier's chunks took each step, the waiting prompt got only what they left, and a
    short P0 prompt behind it waited 0.55 s (Mooncake's synthetic trace, 0.15x)."""
    config = {"scheduler": {"max_num_batched_tokens": 64}}
    executor = NullExecutor(num_device_blocks=1000, num_host_blocks=0, block_size=16, step_s=0.01)
    eng = Engine(parse_config(config), "hybrid", executor, VirtualClock())
    long_p1 = _req(eng, "l", list(range(10000, 18000)), 2, Tier.P1)  # 125 chunks of 64 tokens
    eng.step()
    ahead = _req(eng, "a", list(range(1000, 1200)), 100, Tier.P0)
    eng.step()
    assert ahead.status is RequestStatus.RUNNING and ahead.first_token_time is None
    behind = _req(eng, "b", list(range(2000, 2300)), 2, Tier.P0)  # longer: after a's prompt
    run(eng)
    assert ahead.first_token_time is not None and behind.first_token_time is not None
    # Five steps of its own once a's prompt is in, not a's 100 tokens' worth of steps.
    assert behind.first_token_time - ahead.first_token_time < 0.1
    assert long_p1.finish_reason is FinishReason.LENGTH


def test_a_p3_request_back_in_the_queue_is_shed_by_its_time_there() -> None:
    from tierserve.scheduling.hybrid import HybridPolicy

    policy = HybridPolicy(parse_config({"policy": {"hybrid": {"p3_shed_after_s": 10.0}}}))
    p1 = Request("p1", [1, 2, 3], SamplingParams(max_tokens=8), tier=Tier.P1, arrival_time=100.0)
    policy.add(p1, 100.0)
    back = Request("bg", [1, 2, 3], SamplingParams(max_tokens=8), tier=Tier.P3, arrival_time=0.0)
    policy.prepend(back, 100.0)  # arrived long ago, ran, preempted by recompute at 100 s
    assert policy.to_shed(109.0) == []
    assert [r for r, _ in policy.to_shed(111.0)] == [back]


def test_p0_set_aside_as_stuck_stays_aside_once_a_p0_that_ran_then_has_ended() -> None:
    """The guard that stops keeping a step's tokens for P0 prompts that cannot come in
    lifted itself at every pass once a P0 request running when it was set had ended: every
    step was kept for a P0 prompt over its ceiling (blocks charged to P0 held by a P1 prompt
    only those tokens would finish), and the engine stood still (a randomized driver found it)."""
    from tierserve.executors.sim import build_sim_executor

    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=16))
    executor = build_sim_executor("demo", "a100-80gb", 1, num_device_blocks=40)  # P0's ceiling: 16 blocks
    eng = Engine(config, "hybrid", executor, VirtualClock())
    shared = list(range(1, 33))  # two full blocks

    def add(rid: str, prompt: list[int], max_tokens: int, tier: Tier) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        assert eng.add_request(Request(rid, prompt, params, tier=tier, arrival_time=eng.clock.now()))

    add("S", [*shared, 99], 6, Tier.P0)
    add("X", [7], 12, Tier.P0)  # running when P0 is set aside, then ends
    for _ in range(3):
        eng.step()
    add("B", [*shared, *range(500, 700)], 2, Tier.P1)  # holds S's blocks, on P0's count
    eng.step()
    add("W", list(range(1000, 1225)), 20, Tier.P0)  # 15 blocks: over the ceiling
    idle = 0  # passes in a row that ran nothing: one, to try the P0 again as a P0 ends
    for _ in range(3000):
        if not eng.has_unfinished():
            break
        before = (eng.clock.now(), eng.stats.num_steps)
        eng.step()
        idle = idle + 1 if (eng.clock.now(), eng.stats.num_steps) == before else 0
        assert idle <= 1, "the engine stands still with work to do"
    assert not eng.has_unfinished()
