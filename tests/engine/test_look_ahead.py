"""The pass reads ahead in the queue for its swap-ins (`Scheduler._admitted_ahead`): the
requests it reads are the ones its admission takes, judged as `_admit` judges them, at most
LOOK_AHEAD_MAX of them, and the queue is as it was afterwards."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tests.conftest import make_request
from tests.engine.test_preemption import run
from tierserve.clock import VirtualClock
from tierserve.config import DEFAULT_TIERS, EngineConfig, SchedulerConfig
from tierserve.engine import Engine
from tierserve.engine.scheduler import LOOK_AHEAD_MAX
from tierserve.executors.null import NullExecutor
from tierserve.request import EventKind, Request, RequestStatus
from tierserve.scheduling.base import Policy
from tierserve.scheduling.fair_queue import SERVES_KEPT
from tierserve.scheduling.hybrid import HybridOptions
from tierserve.scheduling.registry import create_policy
from tierserve.scheduling.step import StepBudget
from tierserve.tiers import Tier

POLICIES_WITH_UNDO = ["hybrid", "wfq", "article", "strict", "drr", "drr-tokens"]


def _hybrid_engine(p0_ceiling: float = 1.0) -> Engine:
    """Hybrid on 20 blocks of 4 tokens, no floors; P1 keeps a reserve of 6 blocks (14
    shared), swapping always cheaper than recomputing."""
    tiers = {t: replace(c, floor=0.0, reserve=0.0, ceiling=1.0) for t, c in DEFAULT_TIERS.items()}
    tiers[Tier.P1] = replace(tiers[Tier.P1], reserve=0.3)
    tiers[Tier.P0] = replace(tiers[Tier.P0], ceiling=p0_ceiling)
    config = EngineConfig(
        scheduler=SchedulerConfig(swap_factor=1e9),
        tiers=tiers,
        policy_options={"hybrid": HybridOptions(p3_yields=False, p0_likely_s=0.0)},
    )
    executor = NullExecutor(num_device_blocks=20, num_host_blocks=100, block_size=4)
    return Engine(config, "hybrid", executor, VirtualClock())


def _swaps(req: Request) -> int:
    return [e.kind for e in req.events].count(EventKind.PREEMPTED_SWAP)


def test_the_victim_rules_are_read_with_the_blocks_the_requests_before_take() -> None:
    """P3 `a` (10 of 20 blocks) is swapped out; P0 `w0` (5 blocks) and P1 `w1` (6, inside
    P1's reserve) wait. With w0 in, P3's 10 blocks are more than the 9 shared blocks left:
    P3 borrows, so w1 may take a's place. Read without w0's blocks P3 did not borrow, `a`
    came back, w1 waited for memory and the next pass swapped `a` out again."""
    eng = _hybrid_engine()
    a = make_request(num_prompt=36, max_tokens=40, tier=Tier.P3)
    eng.add_request(a)
    for _ in range(5):
        eng.step()
    assert len(a.block_ids) == 10
    eng.add_request(make_request(num_prompt=68, max_tokens=1, tier=Tier.P0, arrival=eng.clock.now()))
    eng.step()
    assert a.status is RequestStatus.SWAPPED
    now = eng.clock.now()
    w0 = make_request(num_prompt=20, max_tokens=30, tier=Tier.P0, arrival=now)
    w1 = make_request(num_prompt=24, max_tokens=4, tier=Tier.P1, arrival=now)
    eng.add_request(w0)
    eng.add_request(w1)
    for _ in range(3):
        eng.step()
    assert (_swaps(a), w1.num_memory_waits) == (1, 0)
    run(eng)


def _a_swapped_behind_p0_at_its_ceiling(eng: Engine) -> Request:
    """P3 `a` (11 blocks) swapped out for a P1 request, a P0 request running with 5 of
    P0's 6-block ceiling."""
    a = make_request(num_prompt=40, max_tokens=30, tier=Tier.P3)
    eng.add_request(a)
    eng.step()
    eng.add_request(make_request(num_prompt=16, max_tokens=4, tier=Tier.P0, arrival=eng.clock.now()))
    eng.step()
    eng.add_request(make_request(num_prompt=24, max_tokens=1, tier=Tier.P1, arrival=eng.clock.now()))
    eng.step()
    assert a.status is RequestStatus.SWAPPED and len(a.host_block_ids) == 11
    return a


def test_the_look_goes_on_past_a_head_its_tier_sets_aside_at_its_ceiling() -> None:
    """P0 `h` waits over P0's ceiling and P1 `w` behind it: `_admit` sets P0 aside and admits
    `w`. The look stopped at `h`, so `a` came back into w's room, w waited, and `a` was
    swapped out again the next pass."""
    eng = _hybrid_engine(p0_ceiling=0.3)
    a = _a_swapped_behind_p0_at_its_ceiling(eng)
    now = eng.clock.now()
    eng.add_request(make_request(num_prompt=12, max_tokens=2, tier=Tier.P0, arrival=now))
    w = make_request(num_prompt=24, max_tokens=4, tier=Tier.P1, arrival=now)
    eng.add_request(w)
    for _ in range(3):
        eng.step()
    assert (_swaps(a), w.num_memory_waits) == (1, 0)
    run(eng)


def test_the_look_stops_where_only_requests_of_a_tier_set_aside_wait() -> None:
    """Two P0 requests over P0's ceiling: once the first sets P0 aside, the queue has
    nothing to give though a request waits; the look ends there and puts everything back."""
    eng = _hybrid_engine(p0_ceiling=0.3)
    _a_swapped_behind_p0_at_its_ceiling(eng)
    for _ in range(2):
        eng.add_request(make_request(num_prompt=12, max_tokens=2, tier=Tier.P0, arrival=eng.clock.now()))
    run(eng)


def _fill(policy: Policy, n: int, seed: int, tenants: int = 3) -> None:
    rng = random.Random(seed)
    for i in range(n):
        tier = Tier(rng.choice((1, 1, 2, 2, 3)))
        req = make_request(num_prompt=rng.randint(8, 400), tier=tier, arrival=i * 1e-3, request_id=f"r{i}")
        req.tenant = f"t{rng.randrange(tenants)}"
        req.expected_output_tokens = rng.randint(1, 300)
        policy.add(req, req.arrival_time)


def _same_pops(a: Policy, b: Policy, now: float) -> None:
    got = [a.pop(now).request_id for _ in range(len(a))]
    want = [b.pop(now).request_id for _ in range(len(b))]
    first = next((i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y), None)
    assert first is None, f"pop {first} is {got[first]}, not {want[first]}"


@pytest.mark.parametrize("looked", [LOOK_AHEAD_MAX, SERVES_KEPT])
@pytest.mark.parametrize("name", POLICIES_WITH_UNDO)
def test_a_look_as_long_as_the_undo_records_changes_no_pop(name: str, looked: int) -> None:
    """Past SERVES_KEPT pops the fair queues' records fall off and the rest is put back
    inexactly (513 read at 512 seats changed the order of five policies); the pass reads at
    most LOOK_AHEAD_MAX, below it."""
    a, b = create_policy(name, EngineConfig()), create_policy(name, EngineConfig())
    _fill(a, 600, seed=1)
    _fill(b, 600, seed=1)
    for _ in range(37):  # earlier passes' admissions: tags and virtual time move on
        assert a.pop(1.0).request_id == b.pop(1.0).request_id
    with a.looking_ahead(1.0) as waiting:
        assert len([r for _, r in zip(range(looked), waiting, strict=False)]) == looked
    _same_pops(a, b, 1.0)


@pytest.mark.parametrize("name", POLICIES_WITH_UNDO)
def test_a_look_inside_a_pass_that_keeps_undo_records_leaves_its_pops_undoable(name: str) -> None:
    """Turning undo on again for the look forgot the fair queues' records of the pass's
    own pops, which were then put back inexactly."""
    a, b = create_policy(name, EngineConfig()), create_policy(name, EngineConfig())
    _fill(a, 200, seed=3)
    _fill(b, 200, seed=3)
    for _ in range(23):
        assert a.pop(1.0).request_id == b.pop(1.0).request_id
    a.keep_undo(True)
    taken = [a.pop(1.0) for _ in range(40)]
    with a.looking_ahead(1.0) as waiting:
        next(waiting)
    for req in reversed(taken):
        a.put_back(req, 1.0)
    a.forget_undo()
    a.keep_undo(False)
    _same_pops(a, b, 1.0)


def test_a_pass_reads_at_most_look_ahead_max_waiting_requests() -> None:
    """512 seats and thousands of short prompts waiting: the look read one request per free
    seat, 513, past the undo records, and with 20,000 waiting a pass took up to 3 s."""
    config = EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=512))
    executor = NullExecutor(num_device_blocks=4096, num_host_blocks=100, block_size=16)
    eng = Engine(config, "hybrid", executor, VirtualClock())
    for i in range(2000):
        eng.add_request(make_request(num_prompt=8, max_tokens=4, tier=Tier.P1, request_id=f"w{i}"))
    twin = create_policy("hybrid", config)
    for req in list(eng.scheduler.policy):
        twin.add(req, req.arrival_time)
    step = StepBudget(8192, 512)
    eng.scheduler.policy.begin_step(step, [], 0.0)
    ahead, cut = eng.scheduler._admitted_ahead(step, [], 0.0)
    eng.scheduler.policy.end_step(step, 0.0)
    assert (len(ahead), cut) == (LOOK_AHEAD_MAX, False)
    _same_pops(eng.scheduler.policy, twin, 0.0)


@pytest.mark.parametrize(
    ("name", "looks"),
    [
        *((name, False) for name in ("fcfs", "wfq", "drr", "drr-tokens", "vllm-priority")),
        *((name, True) for name in ("hybrid", "strict", "article", "sglang-priority")),
    ],
)
def test_only_a_policy_whose_waiting_requests_may_preempt_reads_ahead(name: str, looks: bool) -> None:
    """Where no waiting request may take a running one's seat or blocks, no swapped request
    stays out for one, and the pass does not read the queue (it cost fcfs-like policies
    time for nothing)."""
    executor = NullExecutor(num_device_blocks=20, num_host_blocks=10, block_size=4)
    eng = Engine(EngineConfig(), name, executor, VirtualClock())
    assert eng.scheduler._looks_ahead is looks
