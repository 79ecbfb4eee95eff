"""TierScheduler on a real vLLM engine (the CPU build), against vanilla vLLM in the same test.

Two engines for the whole module, built once: vLLM with the plug-in, and vanilla vLLM with
`--scheduling-policy priority`. Times are counted in engine steps, never wall time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from tests.integrations.vllm.engines import (
    BLOCK_SIZE,
    MAX_NUM_SEQS,
    PLUGIN,
    Driver,
    checkpoint,
    make_llm,
    prompt,
    scheduler_of,
    write_lora,
)
from tierserve.config import ConfigError
from tierserve.scheduling.hybrid_step import MIN_OTHER_PREFILL_TOKENS, SHAPING_WINDOW
from tierserve.tiers import Tier

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("vllm-ckpt"))


@pytest.fixture(scope="module")
def plugin_llm(model: Path) -> Iterator[Any]:
    yield make_llm(model, scheduler_cls=PLUGIN)


@pytest.fixture(scope="module")
def vanilla_llm(model: Path) -> Iterator[Any]:
    yield make_llm(model, scheduler_cls=None, policy="priority")


@pytest.fixture(scope="module")
def chunking_llm(model: Path) -> Iterator[Any]:
    """The plug-in with no prefix cache and 128-token steps: prompts prefill in chunks. Built
    for the module (an engine torn down in a test tears down vLLM's parallel state, which the
    module's other engines still use)."""
    yield make_llm(model, scheduler_cls=PLUGIN, prefix_caching=False, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def lora_llm(model: Path) -> Iterator[Any]:
    """The plug-in serving LoRA adapters, one at a time (`max_loras` 1)."""
    yield make_llm(model, scheduler_cls=PLUGIN, enable_lora=True, max_loras=1, max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(model: Path) -> tuple[Any, Any]:
    from vllm.lora.request import LoRARequest

    return tuple(LoRARequest(f"a{k}", k, str(write_lora(model.parent, seed=k))) for k in (1, 2))  # type: ignore[return-value]


@pytest.fixture
def lora_driver(lora_llm: Any) -> Iterator[Driver]:
    driver = Driver(lora_llm, plugin=True)
    yield driver
    driver.abort_rest()


@pytest.fixture
def plugin(plugin_llm: Any) -> Iterator[Driver]:
    driver = Driver(plugin_llm, plugin=True)
    yield driver
    driver.abort_rest()  # leave the shared engine idle for the next test


@pytest.fixture
def vanilla(vanilla_llm: Any) -> Iterator[Driver]:
    driver = Driver(vanilla_llm, plugin=False)
    yield driver
    driver.abort_rest()


def _fill_with_p3(
    d: Driver, tag: str, n: int = MAX_NUM_SEQS, prompt_len: int = 100, max_tokens: int = 200
) -> None:
    for i in range(n):
        d.submit(f"{tag}-p3-{i}", prompt(100 + i, prompt_len), max_tokens, Tier.P3)


def test_greedy_outputs_match_vanilla_vllm(plugin: Driver, vanilla: Driver) -> None:
    for d in (plugin, vanilla):
        for i in range(6):
            d.submit(f"greedy-{i}", prompt(i, 20 + 9 * i), 12, Tier.P1)
        d.run(500)
    assert set(plugin.tokens) == {f"greedy-{i}" for i in range(6)}
    for rid, ids in vanilla.tokens.items():
        assert len(ids) == 12
        assert plugin.tokens[rid] == ids, rid


def test_p0_preempts_a_full_batch_and_beats_vanilla_priority(plugin: Driver, vanilla: Driver) -> None:
    sched = scheduler_of(plugin.llm)
    before = sched.tier_metrics.preemptions.labels("P3", "recompute")._value.get()
    for d in (plugin, vanilla):
        _fill_with_p3(d, "ttft")
        # every seat taken and decoding before P0 arrives
        d.run(50, until=lambda d=d: all(f"ttft-p3-{i}" in d.first_token_step for i in range(MAX_NUM_SEQS)))
        d.submit("ttft-p0", prompt(7, 40), 4, Tier.P0)
        d.run(400, until=lambda d=d: "ttft-p0" in d.first_token_step)
    assert plugin.ttft_steps("ttft-p0") <= 2
    assert plugin.ttft_steps("ttft-p0") < vanilla.ttft_steps("ttft-p0")
    assert sched.tier_metrics.preemptions.labels("P3", "recompute")._value.get() > before


def test_p3_flood_never_takes_p0_floor(plugin: Driver) -> None:
    sched = scheduler_of(plugin.llm)
    pool = sched.kv_cache_manager.block_pool
    floor = sched.ledger.partition.floor[Tier.P0]
    assert floor > 0
    _fill_with_p3(plugin, "flood", prompt_len=200, max_tokens=280)
    limit = sched.num_pool_blocks - floor
    lowest_free = pool.get_num_free_blocks()
    peak_p3, steps_at_limit = 0, 0
    for _ in range(300):  # until the flood has pressed on the floor for a while
        plugin.step()
        lowest_free = min(lowest_free, pool.get_num_free_blocks())
        peak_p3 = max(peak_p3, sched.ledger.used[Tier.P3])
        steps_at_limit += peak_p3 >= limit
        if steps_at_limit > 20 or not plugin.llm.llm_engine.has_unfinished_requests():
            break
    # The flood wanted more than the pool (8 x 15 blocks); it got all but P0's floor.
    assert peak_p3 == limit
    assert lowest_free >= floor


def test_borrowed_blocks_come_back_to_their_owner(plugin: Driver) -> None:
    sched = scheduler_of(plugin.llm)
    part = sched.ledger.partition
    assert part.reserve[Tier.P1] > 0
    _fill_with_p3(plugin, "borrow", prompt_len=200, max_tokens=280)
    plugin.run(300, until=lambda: sched.ledger.borrowed()[Tier.P3] > 0)
    for i in range(3):
        plugin.submit(f"borrow-p1-{i}", prompt(50 + i, 150), 8, Tier.P1)
    plugin.run(20, until=lambda: all(f"borrow-p1-{i}" in plugin.first_token_step for i in range(3)))
    # The owner got its reserve back by preempting the borrower, within a couple of steps.
    assert max(plugin.ttft_steps(f"borrow-p1-{i}") for i in range(3)) <= 3
    assert sched.ledger.used[Tier.P1] <= part.entitlement(Tier.P1)


def test_pool_is_whole_and_every_request_ends_once(plugin: Driver) -> None:
    sched = scheduler_of(plugin.llm)
    pool = sched.kv_cache_manager.block_pool
    start_free = pool.get_num_free_blocks()
    added, ended = sched.book.num_added, sched.book.num_ended
    rids = []
    for i in range(16):
        rid = f"mix-{i}"
        plugin.submit(rid, prompt(200 + i, 60 + 10 * i), 40 + 5 * i, Tier(i % 4))
        rids.append(rid)
    plugin.steps(6)
    aborted = ["mix-1", "mix-6", "mix-11"]
    plugin.abort(aborted)
    plugin.submit("mix-late-p0", prompt(300, 50), 10, Tier.P0)
    plugin.run(2000)
    done = [r for r in [*rids, "mix-late-p0"] if r not in aborted]
    assert all(plugin.finished[r] == 1 for r in done)
    assert all(plugin.finished[r] == 0 for r in aborted)
    assert sched.book.num_added - added == sched.book.num_ended - ended == len(rids) + 1
    assert len(sched.book) == 0 and not sched.running and not sched.waiting
    assert pool.get_num_free_blocks() == start_free == sched.num_pool_blocks


def _record_steps(sched: Any, monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """From now on, the ids of the requests each step schedules, one set per step."""
    steps: list[set[str]] = []
    schedule = sched.schedule

    def recording(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        # vLLM's own ids are the caller's with "-" and a random suffix appended.
        steps.append({rid.rsplit("-", 1)[0] for rid in output.num_scheduled_tokens})
        return output

    monkeypatch.setattr(sched, "schedule", recording)
    return steps


def _p3_decoding(plugin: Driver, name: str, count: int, seed: int, max_tokens: int) -> list[str]:
    """`count` P3 requests of 60-token prompts, run until each has its first token."""
    p3 = [f"{name}-{i}" for i in range(count)]
    for i, rid in enumerate(p3):
        plugin.submit(rid, prompt(seed + i, 60), max_tokens, Tier.P3)
    plugin.run(50, until=lambda: all(rid in plugin.first_token_step for rid in p3))
    return p3


def test_the_step_that_prefills_p0_carries_no_other_tier(
    plugin: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    p3 = _p3_decoding(plugin, "solo-p3", 4, seed=400, max_tokens=120)
    steps = _record_steps(scheduler_of(plugin.llm), monkeypatch)
    plugin.submit("solo-p0", prompt(8, 40), 4, Tier.P0)
    plugin.submit("solo-p1", prompt(9, 40), 4, Tier.P1)
    plugin.run(20, until=lambda: "solo-p0" in plugin.first_token_step)
    plugin.steps(2)
    first = next(i for i, ids in enumerate(steps) if "solo-p0" in ids)
    # Four P3 requests were decoding and a P1 waited (seats, tokens and memory to spare
    # for all): P0's prefill ran alone, and the others came back the step after.
    assert steps[first] == {"solo-p0"}
    assert {*p3, "solo-p1"} <= steps[first + 1]
    assert not any(plugin.finished[rid] for rid in p3)


def test_p0_only_steps_leave_the_others_half_of_any_8_steps(
    plugin: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    p3 = _p3_decoding(plugin, "burst-p3", 3, seed=450, max_tokens=200)
    steps = _record_steps(scheduler_of(plugin.llm), monkeypatch)
    for k in range(20):  # a new P0 prompt every step: each step could be P0-only
        plugin.submit(f"burst-p0-{k}", prompt(500 + k, 40), 2, Tier.P0)
        plugin.step()
    others_ran = [set(p3) <= ids for ids in steps]
    assert not all(others_ran)
    window = SHAPING_WINDOW
    assert all(sum(others_ran[i : i + window]) >= window // 2 for i in range(len(steps) - window + 1))


def test_outputs_match_vanilla_vllm_through_p0_only_steps(
    plugin: Driver, vanilla: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = scheduler_of(plugin.llm)
    steps = _record_steps(sched, monkeypatch)
    for d in (plugin, vanilla):
        for i in range(5):
            d.submit(f"same-p{i % 3 + 1}-{i}", prompt(600 + i, 50 + 20 * i), 24, Tier(i % 3 + 1))
        d.steps(3)
        for k in range(3):
            d.submit(f"same-p0-{k}", prompt(650 + k, 40), 6, Tier.P0)
            d.step()
        d.run(500)
    assert any(ids and all(rid.startswith("same-p0") for rid in ids) for ids in steps)
    assert set(plugin.tokens) == set(vanilla.tokens)
    for rid, ids in vanilla.tokens.items():
        assert plugin.tokens[rid] == ids, rid
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == sched.num_pool_blocks


def test_the_policy_sizes_its_steps_by_vllms_limits_not_tierserves_own(plugin: Driver) -> None:
    # `[scheduler]`'s 8,192 tokens configure tierserve's engine; the steps here are vLLM's.
    sched = scheduler_of(plugin.llm)
    limits = sched.tier_policy.config.scheduler
    assert limits.max_num_batched_tokens == sched.scheduler_config.max_num_batched_tokens != 8192
    assert limits.max_num_seqs == sched.scheduler_config.max_num_seqs
    assert sched.tier_policy._shaper.max_step_tokens == sched.scheduler_config.max_num_batched_tokens


def _cap_at_the_least(sched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step bound of no time at all while a P0 is always likely, on a fitted step time:
    the other tiers' prompts keep the least a step gives them."""
    shaper = sched.tier_policy._shaper
    monkeypatch.setattr(shaper, "options", replace(shaper.options, step_bound_x_p0=0.0, p0_likely_s=1e9))
    monkeypatch.setattr(sched.step_times, "estimate_s", lambda n, context: 0.002 + 2e-5 * n)


def _token_recorder(sched: Any) -> tuple[list[dict[str, int]], Any]:
    """The tokens each step gives each request (by the caller's id), filled by the returned
    `schedule` once the caller puts it in place."""
    tokens: list[dict[str, int]] = []
    schedule = sched.schedule

    def recording(*args: Any, **kwargs: Any) -> Any:
        output = schedule(*args, **kwargs)
        tokens.append({rid.rsplit("-", 1)[0]: n for rid, n in output.num_scheduled_tokens.items()})
        return output

    return tokens, recording


def test_while_a_p0_is_likely_the_step_bound_caps_the_other_tiers_prompts(
    plugin: Driver, vanilla: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    sched = scheduler_of(plugin.llm)
    _cap_at_the_least(sched, monkeypatch)
    tokens, recording = _token_recorder(sched)
    for d in (plugin, vanilla):
        p3 = _p3_decoding(d, "cap-p3", 3, seed=700, max_tokens=60)
        d.submit("cap-p0", prompt(710, 40), 2, Tier.P0)
        d.run(20, until=lambda d=d: d.finished["cap-p0"] == 1)
        if d is plugin:
            monkeypatch.setattr(sched, "schedule", recording)
        for i in range(2):
            d.submit(f"cap-p1-{i}", prompt(720 + i, 300), 8, Tier.P1)
        d.run(500)
    p1 = [f"cap-p1-{i}" for i in range(2)]
    chunks = [step for step in tokens if any(rid in step and step[rid] > 1 for rid in p1)]
    assert len(chunks) >= 2 * 300 // MIN_OTHER_PREFILL_TOKENS
    for step in chunks:
        assert sum(n for rid, n in step.items() if rid in p1 and n > 1) <= MIN_OTHER_PREFILL_TOKENS
        assert all(step[rid] == 1 for rid in p3 if rid in step), "a decode keeps its one token"
    assert set(p3) <= set().union(*chunks[:2]), "the P3 decodes ran beside the capped chunks"
    for rid in (*p1, *p3):
        assert plugin.tokens[rid] == vanilla.tokens[rid], rid


def _preempted(sched: Any, tier: Tier) -> float:
    return float(sched.tier_metrics.preemptions.labels(tier.name, "recompute")._value.get())


def test_a_tier_at_its_ceiling_gives_up_its_own_latest_request_not_a_lower_tiers(plugin: Driver) -> None:
    """A running P0 that needs a block past P0's ceiling: vLLM preempts by priority, which
    alone would take every running P3 (whose blocks P0 may not have) before a P0."""
    sched = scheduler_of(plugin.llm)
    ceiling = sched.ledger.partition.ceiling[Tier.P0]
    before = {t: _preempted(sched, t) for t in (Tier.P0, Tier.P3)}
    for i in range(4):
        plugin.submit(f"ceil-p3-{i}", prompt(500 + i, 40), 200, Tier.P3)
    plugin.steps(3)
    for i in range(3):  # 250 prompt tokens: 8 blocks each, 9 once they decode past 256
        plugin.submit(f"ceil-p0-{i}", prompt(520 + i, 250), 100, Tier.P0)
    assert 3 * 8 <= ceiling < 3 * 9
    plugin.run(2000)
    assert _preempted(sched, Tier.P0) > before[Tier.P0], "the ceiling was reached"
    assert _preempted(sched, Tier.P3) == before[Tier.P3], "no P3 was preempted for P0's ceiling"
    assert all(plugin.finished[rid] == 1 for rid in plugin.submitted_at if rid.startswith("ceil-"))
    assert all(r.priority <= Tier.P3 for r in sched.running)


def test_a_prompt_past_its_tiers_ceiling_waits_instead_of_being_preempted_chunk_after_chunk(
    chunking_llm: Any,
) -> None:
    """vLLM checks that a waiting prompt fits whole against the free blocks alone, not less
    the blocks the guard reserves: with chunked prefill (and no prefix cache to make the
    retries cheap) a P0 prompt that P0's ceiling could not hold beside another P0 was
    admitted chunk by chunk and preempted by that ceiling, again and again."""
    d = Driver(chunking_llm, plugin=True)
    sched = scheduler_of(chunking_llm)
    ceiling = sched.ledger.partition.ceiling[Tier.P0]
    d.submit("a", prompt(700, 400), 100, Tier.P0)  # 13 blocks, 16 by its end
    d.run(100, until=lambda: "a" in d.first_token_step)
    d.submit("b", prompt(701, 400), 4, Tier.P0)  # 13 more: past P0's ceiling beside a
    assert 13 + 13 > ceiling >= 16
    d.run(2000)
    assert d.finished["a"] == 1 and d.finished["b"] == 1
    assert _preempted(sched, Tier.P0) == 0, "b was admitted past P0's ceiling and preempted"
    assert d.first_token_step["b"] > d.step_no - 10  # it waited for a to end, then ran


def test_a_step_with_p0_waiting_does_not_walk_the_queue(
    plugin: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiting P0 requests were found by a walk over the whole queue, at every step
    while one waited: 9 ms a step with 20,000 requests queued."""
    from tierserve.integrations.vllm.queue import PolicyRequestQueue

    for i in range(60):
        plugin.submit(f"walk-p2-{i}", prompt(800 + i, 40), 30, Tier.P2)
    plugin.steps(2)
    for i in range(3):
        plugin.submit(f"walk-p0-{i}", prompt(900 + i, 40), 4, Tier.P0)
    monkeypatch.setattr(PolicyRequestQueue, "__iter__", lambda self: pytest.fail("a step walked the queue"))
    plugin.run(100, until=lambda: all(f"walk-p0-{i}" in plugin.first_token_step for i in range(3)))
    assert len(scheduler_of(plugin.llm).waiting) > 40


def _state_gauges(sched: Any) -> list[float]:
    registry = sched.tier_metrics.registry
    names = ("llm_scheduler_queue_depth", "tierserve_kv_blocks_used", "tierserve_kv_blocks_borrowed")
    return [registry.get_sample_value(n, {"priority": t.name}) for n in names for t in Tier]


def test_state_gauges_are_back_to_zero_once_the_engine_idles(plugin: Driver) -> None:
    """The gauges are written on each step; the engine takes no step once idle, so the
    state the last requests leave must be written when they end (finished or aborted)."""
    sched = scheduler_of(plugin.llm)
    for i in range(6):
        plugin.submit(f"idle-{i}", prompt(600 + i, 70), 10, Tier(i % 4))
    plugin.steps(2)
    assert any(_state_gauges(sched))
    plugin.run(500)
    assert _state_gauges(sched) == [0.0] * 12
    for i in range(MAX_NUM_SEQS + 2):  # some running, some queued, then all aborted
        plugin.submit(f"idle-abort-{i}", prompt(620 + i, 70), 100, Tier.P2)
    plugin.steps(2)
    assert any(_state_gauges(sched))
    plugin.abort([f"idle-abort-{i}" for i in range(MAX_NUM_SEQS + 2)])
    assert _state_gauges(sched) == [0.0] * 12


def test_a_tier_that_may_not_hold_one_max_length_request_is_refused_at_start(model: Path) -> None:
    """P0's default ceiling is 0.4 of the pool (25 of 63 blocks, 800 tokens): a P0 prompt
    of --max-model-len 1536 tokens would never be admitted, and would hold up every tier
    queued behind it, so the engine does not start."""
    # The error names where the config came from (here the defaults, as no file or flag set one).
    with pytest.raises(
        ConfigError, match=r"^the plug-in's defaults: tiers\.P0\.ceiling: .* --max-model-len 1536"
    ):
        make_llm(model, scheduler_cls=PLUGIN, max_model_len=1536)


def test_a_shared_prefix_counts_once_toward_its_tier(plugin: Driver, vanilla: Driver) -> None:
    """Eight P0 requests behind one 256-token system prompt: counted once per holder, its 8
    blocks made P0 look past its ceiling (25 of 63 blocks) with 49 free, and the requests
    ran in waves, preempting each other. Counted once, they run together, as on vanilla."""
    sched = scheduler_of(plugin.llm)
    pool = sched.kv_cache_manager.block_pool
    shared = prompt(900, 256)
    rids = [f"shared-p0-{i}" for i in range(8)]
    for d in (plugin, vanilla):
        for i, rid in enumerate(rids):
            d.submit(rid, shared + prompt(901 + i, 8), 30, Tier.P0)
    for _ in range(60):
        plugin.step()
        in_use = sched.num_pool_blocks - pool.get_num_free_blocks()
        assert sum(sched.ledger.used) == in_use  # each block once
        assert sched.ledger.used[Tier.P0] <= sched.ledger.partition.ceiling[Tier.P0]
        if not plugin.llm.llm_engine.has_unfinished_requests():
            break
    vanilla.run(200)
    assert all(plugin.finished[rid] == 1 for rid in rids)
    assert max(plugin.ttft_steps(rid) for rid in rids) == max(vanilla.ttft_steps(rid) for rid in rids)
    assert not any(sched.requests[rid].num_preemptions for rid in rids if rid in sched.requests)


def test_a_duplicate_cached_block_counts_once(plugin: Driver) -> None:
    """Identical prompts and greedy output: each request computes its own copy of the same
    output blocks, and vLLM caches the copies side by side. A later prompt that extends
    them hits the first copy of each: the one of a finished request for the first output
    block (revived, its own), the one a running request still holds for the second. That
    second block then sits after blocks of their own in both requests' lists; counted as
    their own by walks that stopped at the first one, it made the tiers' counts pass the
    blocks in use (P3 at 66 blocks on a 63-block pool with 24 such requests)."""
    sched = scheduler_of(plugin.llm)
    pool = sched.kv_cache_manager.block_pool
    system = prompt(950, BLOCK_SIZE)

    def check() -> None:
        in_use = sched.num_pool_blocks - pool.get_num_free_blocks()
        assert sum(sched.ledger.used) == in_use <= sched.num_pool_blocks  # each block once

    plugin.submit("dup-first", system, BLOCK_SIZE + 8, Tier.P1)  # its first output block full
    plugin.steps(4)  # its copies enter vLLM's cache first
    plugin.submit("dup-second", system, 5 * BLOCK_SIZE, Tier.P3)
    plugin.run(400, until=lambda: len(plugin.tokens.get("dup-second", [])) > 2 * BLOCK_SIZE)
    assert plugin.finished["dup-first"] == 1
    output = plugin.tokens["dup-second"]
    assert output[:BLOCK_SIZE] == plugin.tokens["dup-first"][:BLOCK_SIZE]  # greedy: one block, two copies
    plugin.submit("dup-extends", system + output[: 2 * BLOCK_SIZE + 1], 4, Tier.P2)
    for _ in range(400):
        plugin.step()
        check()
        if not plugin.llm.llm_engine.has_unfinished_requests():
            break
    assert all(plugin.finished[rid] == 1 for rid in ("dup-first", "dup-second", "dup-extends"))


def test_a_seat_for_p0_is_taken_from_the_request_with_least_work_done(plugin: Driver) -> None:
    """Eight P3 requests admitted ten steps apart hold every seat; the P0 takes the seat of
    the latest (least computed), not of the oldest (the shadows' computed counts were
    never updated, so every victim tied)."""
    sched = scheduler_of(plugin.llm)
    preempted: list[tuple[str, int]] = []
    original = sched._preempt_request

    def spy(request: Any, *args: Any, **kwargs: Any) -> None:
        preempted.append((request.request_id, request.num_computed_tokens))
        original(request, *args, **kwargs)

    sched._preempt_request = spy
    try:
        for i in range(MAX_NUM_SEQS):
            plugin.submit(f"seat-p3-{i}", prompt(5000 + i, 10), 150, Tier.P3)
            plugin.steps(10)
        computed = {r.request_id: r.num_computed_tokens for r in sched.running}
        plugin.submit("seat-p0", prompt(5100, 10), 5, Tier.P0)
        plugin.run(5, until=lambda: "seat-p0" in plugin.first_token_step)
    finally:
        del sched._preempt_request
    assert len(computed) == MAX_NUM_SEQS and preempted
    latest = min(computed, key=computed.__getitem__)
    assert preempted[0][0] == latest and latest.startswith(f"seat-p3-{MAX_NUM_SEQS - 1}-")  # vLLM's id suffix


def test_a_request_whose_blocks_a_connector_still_writes_is_not_preempted_for_p0(plugin: Driver) -> None:
    """With an asynchronous KV connector vLLM frees a request's blocks only once the step that
    may write them has been processed (`_request_blocks_can_be_freed`). Preempting such a
    request makes no room this step, so the P0 takes the seat of another: here the latest
    P3, the one it would otherwise take (the test above), is marked as still written."""
    sched = scheduler_of(plugin.llm)
    preempted: list[str] = []
    original = sched._preempt_request

    def spy(request: Any, *args: Any, **kwargs: Any) -> None:
        preempted.append(request.request_id)
        original(request, *args, **kwargs)

    for i in range(MAX_NUM_SEQS):
        plugin.submit(f"written-p3-{i}", prompt(5200 + i, 10), 150, Tier.P3)
        plugin.steps(10)
    latest = min(sched.running, key=lambda r: r.num_computed_tokens).request_id
    assert latest.startswith(f"written-p3-{MAX_NUM_SEQS - 1}-")
    sched._preempt_request = spy
    sched._request_blocks_can_be_freed = lambda request: request.request_id != latest
    try:
        plugin.submit("written-p0", prompt(5300, 10), 5, Tier.P0)
        plugin.run(5, until=lambda: "written-p0" in plugin.first_token_step)
    finally:  # before the fixture aborts the rest: a deferred free would keep their blocks
        del sched._preempt_request, sched._request_blocks_can_be_freed
    assert preempted and latest not in preempted
    assert plugin.ttft_steps("written-p0") <= 2


def test_a_p0_burst_counts_a_prefix_it_shares_and_the_watermark_once(plugin: Driver) -> None:
    """Three P0 prompts share three uncached blocks; vLLM caches a block as it allocates it,
    so the second and third admissions of the pass find the first's. The room made for the
    burst counted those blocks once a request, and vLLM's watermark once a request too (each
    admission must leave it free, so the last one's check covers the group): up to twice
    the blocks, and as many more requests preempted for them. Counted here against the
    blocks vLLM takes, with a watermark of 2 blocks."""
    sched = scheduler_of(plugin.llm)
    inner = sched.kv_cache_manager.inner
    counted: list[int] = []
    original = sched._burst_need

    def spy(group: Any) -> int:
        counted.append(need := original(group))
        return need

    shared = prompt(5400, 3 * BLOCK_SIZE)
    burst = [f"shared-p0-{i}" for i in range(3)]
    sched._burst_need, watermark, inner.watermark_blocks = spy, inner.watermark_blocks, 2
    try:
        free = inner.block_pool.get_num_free_blocks()
        for i, rid in enumerate(burst):
            plugin.submit(rid, shared + prompt(5500 + i, 20), 4, Tier.P0)
        plugin.step()
        taken = free - inner.block_pool.get_num_free_blocks()
    finally:
        del sched._burst_need
        inner.watermark_blocks = watermark
    assert all(plugin.first_token_step.get(rid) == plugin.step_no for rid in burst)  # one pass
    assert taken == 4 + 1 + 1  # the shared blocks once, a block of its own tail each
    assert counted[0] == taken + 2


def test_a_burst_of_p0_starts_together_through_a_full_batch(plugin: Driver) -> None:
    """P3 requests hold every seat; three P0 requests arrive at once. Room was made for the
    head of the queue only, and vLLM's pass never preempts for a waiting request, so the
    others started one step after another."""
    _fill_with_p3(plugin, "burst")
    plugin.run(50, until=lambda: all(f"burst-p3-{i}" in plugin.first_token_step for i in range(MAX_NUM_SEQS)))
    burst = [f"burst-p0-{i}" for i in range(3)]
    for i, rid in enumerate(burst):
        plugin.submit(rid, prompt(7000 + i, 40), 4, Tier.P0)
    plugin.run(20, until=lambda: all(rid in plugin.first_token_step for rid in burst))
    assert {plugin.first_token_step[rid] for rid in burst} == {plugin.first_token_step[burst[0]]}
    assert max(plugin.ttft_steps(rid) for rid in burst) <= 2


def test_a_capped_step_gives_waiting_p0_prompts_their_tokens_not_a_running_lower_prompt(
    plugin: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The capped budget counts the waiting P0 prompts' tokens, but vLLM serves running
    requests first: a running P3 prompt took them (64 + 40 per waiting P0 a step, past its
    cap) and P0 prompts arriving every step waited up to 4 steps."""
    sched = scheduler_of(plugin.llm)
    _cap_at_the_least(sched, monkeypatch)
    tokens, recording = _token_recorder(sched)
    monkeypatch.setattr(sched, "schedule", recording)
    plugin.submit("held-p3", prompt(900, 480), 4, Tier.P3)
    p0 = [f"held-p0-{k}" for k in range(16)]
    for k, rid in enumerate(p0):
        plugin.submit(rid, prompt(1000 + k, 40), 2, Tier.P0)
        plugin.step()
    plugin.run(300)
    assert plugin.finished["held-p3"] == 1, "the P3 prompt was not starved"
    assert max(plugin.ttft_steps(rid) for rid in p0) <= 2
    assert all(step.get("held-p3", 0) <= MIN_OTHER_PREFILL_TOKENS for step in tokens), "the cap holds"


def test_a_ceilings_marks_do_not_make_a_lower_tiers_allocation_preempt_p0(
    plugin: Driver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P0 at its ceiling and the pool full; on one step a P0 request and a P3 request each
    need a block. The P0's ceiling marks P0's running requests as vLLM's first victims; kept
    for the rest of the pass, the P3's failed allocation then took a P0 request too."""
    sched = scheduler_of(plugin.llm)
    shaper = sched.tier_policy._shaper
    monkeypatch.setattr(shaper, "options", replace(shaper.options, p0_solo_prefill=False, p0_likely_s=0.0))
    assert sched.ledger.partition.ceiling[Tier.P0] == 25 and sched.num_pool_blocks == 63
    guard = sched.kv_cache_manager
    allocating: list[Tier] = []  # the tier of the request whose allocation runs
    preempted_for: list[tuple[Tier, Tier]] = []  # (the allocating request's tier, the victim's)
    allocate, preempt = guard.allocate_slots, sched._preempt_request

    def allocate_spy(request: Any, *args: Any, **kwargs: Any) -> Any:
        allocating.append(sched.book.tier(request.request_id))
        return allocate(request, *args, **kwargs)

    def preempt_spy(request: Any, *args: Any, **kwargs: Any) -> None:
        preempted_for.append((allocating[-1], sched.book.tier(request.request_id)))
        preempt(request, *args, **kwargs)

    monkeypatch.setattr(guard, "allocate_slots", allocate_spy)
    monkeypatch.setattr(sched, "_preempt_request", preempt_spy)
    # P0: 9 + 8 blocks; P3: 10 + 10 + 11 blocks; none grows for a dozen steps.
    for seed, (rid, length, tier) in enumerate((("inv-b", 270, 0), ("inv-c", 225, 0), ("inv-y1", 300, 3),
                                                ("inv-y2", 300, 3), ("inv-y3", 340, 3))):  # fmt: skip
        plugin.submit(rid, prompt(1100 + seed, length), 100, Tier(tier))
    plugin.run(10, until=lambda: all(r in plugin.first_token_step for r in ("inv-y1", "inv-y2", "inv-y3")))
    # A and X fill 7 blocks each and need an 8th on the same step; D (1 block) brings P0 to
    # its ceiling of 25 and the pool to all 63 blocks.
    for seed, (rid, length, tier) in enumerate((("inv-a", 220, 0), ("inv-d", 20, 0), ("inv-x", 220, 3))):
        plugin.submit(rid, prompt(1200 + seed, length), 100, Tier(tier))
    plugin.steps(12)
    assert (Tier.P0, Tier.P0) in preempted_for, "P0's ceiling bound"
    assert any(requester is Tier.P3 for requester, _ in preempted_for), "a P3 allocation failed"
    assert (Tier.P3, Tier.P0) not in preempted_for


def test_a_request_vllm_skips_for_many_steps_costs_its_tenant_nothing(plugin: Driver) -> None:
    """vLLM skips a waiting request it cannot run yet (here: its grammar still compiling) by
    popping it from the queue and putting it back at the end of the pass. The plug-in charged
    each such pop to the request's tenant as a serve: with one seat free, tenants a and b
    sharing P2 and b's first request skipped, a got 11 of the 12 admissions."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    sched = scheduler_of(plugin.llm)
    long = [f"skip-seat-{i}" for i in range(MAX_NUM_SEQS - 1)]  # all seats but one, for the test
    for i, rid in enumerate(long):
        plugin.submit(rid, prompt(1100 + i, 20), 150, Tier.P1)
    plugin.run(20, until=lambda: all(rid in plugin.first_token_step for rid in long))
    for i in range(16):
        for tenant in ("a", "b"):
            plugin.submit(
                f"skip-{tenant}{i}", prompt(1000 + 2 * i + (tenant == "b"), 40), 3, Tier.P2, tenant=tenant
            )
    (blocked,) = (r for rid, r in sched.requests.items() if rid.startswith("skip-b0-"))
    blocked.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    blocked.structured_output_request = SimpleNamespace(grammar=None)  # not compiled yet

    def p2_started() -> list[str]:
        return [rid for rid in plugin.first_token_step if rid[len("skip-")] in "ab"]

    plugin.run(120, until=lambda: len(p2_started()) >= 12)
    started = "".join(rid[len("skip-")] for rid in p2_started())
    assert "skip-b0" not in plugin.first_token_step
    assert abs(started.count("a") - started.count("b")) <= 2, f"not half each: {started}"
    blocked.status, blocked.structured_output_request = RequestStatus.WAITING, None  # compiled
    plugin.run(20, until=lambda: "skip-b0" in plugin.first_token_step)
    assert p2_started()[len(started) :].index("skip-b0") <= 1, f"b0 waited behind {p2_started()}"


def _tokens_now(d: Driver) -> int:
    return sum(len(ids) for ids in d.tokens.values())


def test_p0_takes_a_seat_where_vllm_admits_fewer_than_it_runs(plugin: Driver) -> None:
    """With `max_num_active_seqs` below `max_num_seqs` the plug-in counted seats against
    the larger: a P0 was judged to fit, nobody was preempted, and P0-only steps with nothing
    to run came until a P3 ended (213 steps to its first token, 97 of them empty)."""
    sched = scheduler_of(plugin.llm)
    active = sched.max_num_active_reqs
    sched.max_num_active_reqs = 2
    try:
        for i in range(2):
            plugin.submit(f"active-p3-{i}", prompt(1200 + i, 40), 150, Tier.P3)
        plugin.run(20, until=lambda: all(f"active-p3-{i}" in plugin.first_token_step for i in range(2)))
        plugin.submit("active-p0", prompt(1210, 30), 4, Tier.P0)
        empty = 0
        for _ in range(20):
            if "active-p0" in plugin.first_token_step:
                break
            before = _tokens_now(plugin)
            plugin.step()
            empty += _tokens_now(plugin) == before
        assert plugin.ttft_steps("active-p0") <= 3, "the P0 waited for a P3 to end"
        assert empty == 0
    finally:
        plugin.abort_rest()
        sched.max_num_active_reqs = active


def test_a_wait_pause_lets_the_running_requests_finish_and_preempts_nobody(plugin: Driver) -> None:
    """vLLM's "wait" pause admits nobody and drains what runs. The plug-in still made room
    and ran P0-only steps for a waiting P0: two running P3 requests were preempted into the
    queue, which the pause does not admit from, and 36 of 80 steps were empty."""
    from vllm.v1.core.sched.interface import PauseState

    sched = scheduler_of(plugin.llm)
    for i in range(MAX_NUM_SEQS):
        plugin.submit(f"pause-p3-{i}", prompt(1300 + i, 40), 30, Tier.P3)
    plugin.run(20, until=lambda: all(f"pause-p3-{i}" in plugin.first_token_step for i in range(MAX_NUM_SEQS)))
    sched.set_pause_state(PauseState.PAUSED_NEW)
    try:
        plugin.submit("pause-p0", prompt(1320, 30), 4, Tier.P0)
        empty = 0
        running = lambda: sum(not plugin.finished[f"pause-p3-{i}"] for i in range(MAX_NUM_SEQS))  # noqa: E731
        for _ in range(60):
            if not running():
                break
            before = _tokens_now(plugin)
            plugin.step()
            empty += _tokens_now(plugin) == before
        assert not running(), "the pause never drained"
        assert empty == 0 and all(r.num_preemptions == 0 for r in sched.requests.values())
        assert "pause-p0" not in plugin.first_token_step  # paused: not admitted
    finally:
        sched.set_pause_state(PauseState.UNPAUSED)
    plugin.run(20, until=lambda: "pause-p0" in plugin.first_token_step)


def test_a_p0_vllm_skips_takes_no_room_and_no_p0_only_step(plugin: Driver) -> None:
    """A P0 whose grammar still compiles is skipped by vLLM's pass; room was made for it
    and P0-only steps held the other tiers back around it: steps with nothing to run."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    sched = scheduler_of(plugin.llm)
    for i in range(MAX_NUM_SEQS):
        plugin.submit(f"gram-p3-{i}", prompt(1400 + i, 40), 60, Tier.P3)
    plugin.run(20, until=lambda: all(f"gram-p3-{i}" in plugin.first_token_step for i in range(MAX_NUM_SEQS)))
    plugin.submit("gram-p0", prompt(1420, 30), 4, Tier.P0)
    (blocked,) = (r for rid, r in sched.requests.items() if rid.startswith("gram-p0"))
    blocked.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    blocked.structured_output_request = SimpleNamespace(grammar=None)  # not compiled yet
    empty = 0
    for _ in range(6):
        before = _tokens_now(plugin)
        plugin.step()
        empty += _tokens_now(plugin) == before
    assert empty == 0 and all(r.num_preemptions == 0 for r in sched.requests.values())
    blocked.status, blocked.structured_output_request = RequestStatus.WAITING, None  # compiled
    plugin.run(10, until=lambda: "gram-p0" in plugin.first_token_step)


def _preemptions(sched: Any, prefix: str) -> int:
    return sum(r.num_preemptions for rid, r in sched.requests.items() if rid.startswith(prefix))


def _steps_until(d: Driver, rids: list[str], max_steps: int = 12) -> int:
    """Step until every one of `rids` has its first token; the steps that gave nobody a token."""
    empty = 0
    for _ in range(max_steps):
        if all(rid in d.first_token_step for rid in rids):
            return empty
        before = _tokens_now(d)
        d.step()
        empty += _tokens_now(d) == before
    raise AssertionError(f"no first token for {[r for r in rids if r not in d.first_token_step]}")


def test_a_p0_vllm_skips_inside_a_burst_takes_no_seat_from_the_running(plugin: Driver) -> None:
    """Room for a burst of P0 prompts counted one that vLLM skips this pass (its grammar still
    compiling): a running request was preempted for a seat nobody took."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    sched = scheduler_of(plugin.llm)
    _fill_with_p3(plugin, "burst")
    plugin.run(30, until=lambda: all(f"burst-p3-{i}" in plugin.first_token_step for i in range(MAX_NUM_SEQS)))
    for i in range(3):
        plugin.submit(f"burst-p0-{i}", prompt(1500 + i, 40), 4, Tier.P0)
    (middle,) = (r for rid, r in sched.requests.items() if rid.startswith("burst-p0-1"))
    middle.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    middle.structured_output_request = SimpleNamespace(grammar=None)
    try:
        assert _steps_until(plugin, ["burst-p0-0", "burst-p0-2"]) == 0
        assert _preemptions(sched, "burst-p3") == 2  # one seat for each P0 that runs
    finally:
        middle.status, middle.structured_output_request = RequestStatus.WAITING, None


def test_a_paused_streaming_session_holds_a_seat_a_p0_must_be_given(plugin: Driver) -> None:
    """vLLM counts a streaming session waiting for input as holding a seat; counted free, a
    P0 was judged to fit, nobody was preempted, and P0-only steps ran with nothing to run."""
    sched = scheduler_of(plugin.llm)
    _fill_with_p3(plugin, "seat", n=MAX_NUM_SEQS - 1)
    seated = [f"seat-p3-{i}" for i in range(MAX_NUM_SEQS - 1)]
    plugin.run(30, until=lambda: all(rid in plugin.first_token_step for rid in seated))
    sched.num_waiting_for_streaming_input = 1  # a paused stream holds the last seat
    try:
        plugin.submit("seat-p0", prompt(1600, 40), 4, Tier.P0)
        assert _steps_until(plugin, ["seat-p0"]) == 0
        assert plugin.ttft_steps("seat-p0") <= 2 and _preemptions(sched, "seat-p3") == 1
    finally:
        sched.num_waiting_for_streaming_input = 0


def test_a_p0_whose_stale_output_is_in_flight_takes_no_room_this_pass(plugin: Driver) -> None:
    """vLLM skips a waiting request whose earlier output is still being delivered (async
    scheduling); room was made for it too: a running request preempted for nothing."""
    sched = scheduler_of(plugin.llm)
    _fill_with_p3(plugin, "stale")
    plugin.run(30, until=lambda: all(f"stale-p3-{i}" in plugin.first_token_step for i in range(MAX_NUM_SEQS)))
    plugin.submit("stale-p0-0", prompt(1700, 40), 4, Tier.P0)
    (stale,) = (r for rid, r in sched.requests.items() if rid.startswith("stale-p0-0"))
    stale.num_stale_output_tokens, stale.drop_stale_output = 1, False
    plugin.submit("stale-p0-1", prompt(1701, 40), 4, Tier.P0)
    try:
        assert _steps_until(plugin, ["stale-p0-1"]) == 0
        assert _preemptions(sched, "stale-p3") == 1
    finally:
        stale.num_stale_output_tokens = 0


def _adapters_running(llm: Any) -> set[int]:
    return {r.lora_request.lora_int_id for r in scheduler_of(llm).running if r.lora_request}


def _run_checking_adapters(driver: Driver, max_steps: int) -> None:
    """Step until every request ends, never more adapters running than `max_loras` (1)."""
    for _ in range(max_steps):
        if not driver.llm.llm_engine.has_unfinished_requests():
            return
        driver.step()
        assert len(_adapters_running(driver.llm)) <= 1
    raise AssertionError(f"still running after {max_steps} steps")


def test_a_p0_of_another_adapter_takes_the_slot_of_a_lower_tier(lora_driver: Driver, adapters: Any) -> None:
    """vLLM runs at most max_loras adapters and never preempts for a slot: a P0 of another
    adapter waited for the P3 to end (58 steps on vanilla vLLM), and the plug-in's P0-only
    step, which holds the P3 back, let vLLM admit the P0 beside it, and its next pass
    stopped the engine (an assertion on max_loras). The P0 takes the P3's slot now."""
    driver = lora_driver
    a1, a2 = adapters
    driver.submit("p3", prompt(1, 40), 60, tier=3, lora=a1)
    driver.steps(3)
    driver.submit("p0", prompt(2, 40), 4, tier=0, lora=a2)
    _run_checking_adapters(driver, 300)
    assert driver.ttft_steps("p0") <= 2
    assert driver.finished == {"p3": 1, "p0": 1} and len(driver.tokens["p3"]) == 60


def test_a_request_whose_adapter_has_no_slot_waits_as_on_vllm(lora_driver: Driver, adapters: Any) -> None:
    """A P0 may not take a slot from another P0, nor a P3 from a P3: each waits for the
    slot, and base-model requests run meanwhile."""
    driver = lora_driver
    a1, a2 = adapters
    driver.submit("p0-a", prompt(3, 40), 20, tier=0, lora=a1)
    driver.submit("p3-a", prompt(4, 40), 20, tier=3, lora=a1)
    driver.steps(2)
    driver.submit("p0-b", prompt(5, 40), 4, tier=0, lora=a2)
    driver.submit("p3-b", prompt(6, 40), 4, tier=3, lora=a2)
    driver.submit("p1-base", prompt(7, 40), 4, tier=1)
    _run_checking_adapters(driver, 400)
    assert all(driver.finished[r] == 1 for r in driver.submitted_at)
    # The base model's request did not wait for an adapter slot.
    assert driver.first_token_step["p1-base"] < driver.first_token_step["p0-b"]
    assert driver.first_token_step["p0-b"] > driver.first_token_step["p0-a"] + 15


def test_a_running_request_held_back_a_step_keeps_its_adapters_slot(
    lora_driver: Driver, adapters: Any
) -> None:
    """vLLM counts the adapters of the requests its pass schedules: one sitting a step out
    (as the plug-in's P0-only and capped steps make the other tiers do) was not counted, and
    a waiting request of another adapter was admitted beside it."""
    driver = lora_driver
    a1, a2 = adapters
    driver.submit("p3-a", prompt(8, 40), 30, tier=3, lora=a1)
    driver.steps(2)
    driver.submit("p3-b", prompt(9, 40), 4, tier=3, lora=a2)
    scheduler = scheduler_of(lora_driver.llm)
    (held,) = scheduler.running
    held.next_decode_eligible_step = scheduler.current_step + 2  # sits the next step out
    _run_checking_adapters(driver, 300)
    assert driver.finished == {"p3-a": 1, "p3-b": 1}
    assert driver.first_token_step["p3-b"] > driver.submitted_at["p3-b"] + 25


def test_a_skipped_head_takes_no_adapters_slot(lora_driver: Driver, adapters: Any) -> None:
    """A P0 of another adapter whose grammar still compiles (vLLM skips it) had the P3's
    slot freed for it at every step: the P3 was preempted, readmitted in the same pass and
    preempted again, 10 times in 10 steps (a review)."""
    from types import SimpleNamespace

    from vllm.v1.request import RequestStatus

    driver = lora_driver
    a1, a2 = adapters
    sched = scheduler_of(lora_driver.llm)
    driver.submit("slot-p3", prompt(11, 40), 60, tier=3, lora=a1)
    driver.steps(3)
    driver.submit("slot-p0", prompt(12, 40), 4, tier=0, lora=a2)
    (blocked,) = (r for rid, r in sched.requests.items() if rid.startswith("slot-p0"))
    blocked.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    blocked.structured_output_request = SimpleNamespace(grammar=None)  # not compiled yet
    try:
        driver.steps(6)
    finally:
        blocked.status, blocked.structured_output_request = RequestStatus.WAITING, None
    assert _preemptions(sched, "slot-p3") == 0 and len(driver.tokens["slot-p3"]) >= 8
    driver.steps(2)  # compiled: it takes the slot now
    assert "slot-p0" in driver.first_token_step and _preemptions(sched, "slot-p3") == 1
    _run_checking_adapters(driver, 200)
    assert driver.finished == {"slot-p3": 1, "slot-p0": 1}


def test_a_head_that_would_not_fit_takes_no_adapters_slot(lora_driver: Driver, adapters: Any) -> None:
    """The slot is part of the room made for the head, all or nothing: a P3 was preempted for
    a P0 of another adapter that P0's ceiling then kept out, and lost 10 steps (a review)."""
    driver = lora_driver
    a1, a2 = adapters
    sched = scheduler_of(lora_driver.llm)
    ceiling = sched.ledger.partition.ceiling[Tier.P0]
    # Base-model P0 requests hold all but a block of P0's ceiling (none is its victim).
    for k in range(2):
        driver.submit(f"full-p0-{k}", prompt(13 + k, 360), 20, tier=0)
    driver.submit("full-p3", prompt(16, 40), 60, tier=3, lora=a1)
    started = {"full-p0-0", "full-p0-1", "full-p3"}
    driver.run(20, until=lambda: started <= driver.first_token_step.keys())
    assert ceiling - sched.ledger.used[Tier.P0] <= 2
    driver.submit("full-p0-b", prompt(15, 150), 4, tier=0, lora=a2)  # 5 blocks
    before = len(driver.tokens["full-p3"])
    driver.steps(4)
    assert _preemptions(sched, "full-p3") == 0 and len(driver.tokens["full-p3"]) - before == 4
    assert "full-p0-b" not in driver.first_token_step
    _run_checking_adapters(driver, 300)
    assert all(driver.finished[r] == 1 for r in driver.submitted_at)
