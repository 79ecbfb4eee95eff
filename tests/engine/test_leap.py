"""The fast simulation (`Engine(fast=True)`, engine/leap.py) gives the step-by-step results:
every request's record, the window's counters and the cell's summary, to the bit."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tierserve.bench.cell import BenchSetup, Cell, Driven, drive
from tierserve.bench.driver import DriverConfig, DriverResult, run_workload
from tierserve.bench.sim_speed import compare, compare_runs
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig
from tierserve.engine import Engine
from tierserve.executors.null import NullExecutor
from tierserve.executors.sim.executor import build_sim_executor
from tierserve.request import Request, SamplingParams
from tierserve.scheduling import POLICIES
from tierserve.scheduling.step import StepBudget
from tierserve.tiers import Tier


def _both(setup: BenchSetup, cell: Cell) -> tuple[Driven, Driven]:
    return drive(replace(setup, sim_mode="step"), cell), drive(replace(setup, sim_mode="fast"), cell)


def _assert_same(setup: BenchSetup, cell: Cell) -> tuple[Driven, Driven]:
    step, fast = _both(setup, cell)
    comparison = compare_runs(setup, cell, step, fast)
    assert comparison.mismatches == 0
    assert comparison.max_rel_diff <= 1e-12
    assert [r.request_id for r in step.run.records] == [r.request_id for r in fast.run.records]
    return step, fast


@pytest.mark.parametrize("policy", ["fcfs", "vllm-priority", "hybrid"])
@pytest.mark.parametrize("clients", [8, 64])
def test_fast_mode_equals_step_mode_on_the_default_workload(policy: str, clients: int) -> None:
    setup = BenchSetup(num_measured=60)
    step, _ = _assert_same(setup, Cell("default", "closed", clients, policy, 3))
    assert step.run.stats.num_steps > 100


def _small_cache_run(fast: bool, policy: str, p1_ceiling: float | None = None) -> DriverResult:
    """memory-pressure's traffic on a 3000-block cache: 24 clients outgrow it (and, with
    `p1_ceiling`, P1 its share of it)."""
    executor = build_sim_executor("llama-3.1-70b", "a100-80gb", 4, num_device_blocks=3000)
    clock, setup = VirtualClock(), BenchSetup()
    config = setup.engine_config()
    if p1_ceiling is not None:
        p1 = replace(config.tiers[Tier.P1], reserve=0.0, ceiling=p1_ceiling)
        config = replace(config, tiers={**config.tiers, Tier.P1: p1})
    engine = Engine(config, policy, executor, clock, fast=fast)
    specs = setup.stream("memory-pressure", 1, executor.spec.max_model_len)
    config = DriverConfig(num_measured=15, num_warmup=24, concurrency=24, think_time_s=0.5, seed=1)
    return run_workload(engine, clock, specs, config)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_leaps_and_gives_the_step_by_step_results(policy: str) -> None:
    setup = BenchSetup(num_measured=40)
    _, fast = _assert_same(setup, Cell("default", "closed", 32, policy, 5))
    assert POLICIES[policy].leaps_decodes and fast.run.stats.num_leapt_steps > 0


@pytest.mark.parametrize("policy", ["vllm-priority", "hybrid"])
def test_fast_mode_equals_step_mode_when_memory_runs_out(policy: str) -> None:
    """Preemptions (recompute under vllm-priority, swap under hybrid) happen in both runs."""
    step, fast = _small_cache_run(False, policy), _small_cache_run(True, policy)
    assert sum(r.num_swaps + r.num_recomputes for r in step.records) > 0
    assert fast.stats.num_leapt_steps > 0
    for a, b in ((step.records, fast.records), (step.window, fast.window), (step.end_s, fast.end_s)):
        comparison = compare(a, b)
        assert comparison.mismatches == 0 and comparison.max_rel_diff == 0.0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_fast_mode_leaps_while_requests_wait_and_gives_the_step_by_step_results(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a cache the clients outgrow, requests wait for memory (and some are swapped out)
    through runs of decode steps: the fast mode leaps over those too, each step's pass
    checked by `Scheduler.decodes_only`, and gives the step-by-step results; without
    leaping while requests wait it leaps over fewer steps, to the same results."""
    step, fast = _small_cache_run(False, policy), _small_cache_run(True, policy)
    monkeypatch.setattr(POLICIES[policy], "leaps_while_waiting", False)
    only_idle = _small_cache_run(True, policy)
    # Memory runs short: requests wait for it, or are preempted (strict's P0 never waits).
    assert sum(r.num_memory_waits + r.num_swaps + r.num_recomputes for r in step.records) > 0
    for run in (fast, only_idle):
        for a, b in ((step.records, run.records), (step.window, run.window), (step.end_s, run.end_s)):
            comparison = compare(a, b)
            assert comparison.mismatches == 0 and comparison.max_rel_diff == 0.0
    assert fast.stats.num_leapt_steps > only_idle.stats.num_leapt_steps


def test_fast_mode_equals_step_mode_when_a_tier_waits_at_its_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """P1 held to 10 % of the cache: its heads wait for P1's own blocks while hybrid admits
    the other tiers past them (`Policy.hold_tier`); the fast mode gives the same results."""
    held: list[Tier] = []
    hold = POLICIES["hybrid"].hold_tier

    def counted(self: Any, tier: Tier) -> None:
        held.append(tier)
        hold(self, tier)

    monkeypatch.setattr(POLICIES["hybrid"], "hold_tier", counted)
    step = _small_cache_run(False, "hybrid", 0.1)
    assert Tier.P1 in held  # the path under test ran
    fast = _small_cache_run(True, "hybrid", 0.1)
    assert fast.stats.num_leapt_steps > 0
    for a, b in ((step.records, fast.records), (step.window, fast.window), (step.end_s, fast.end_s)):
        comparison = compare(a, b)
        assert comparison.mismatches == 0 and comparison.max_rel_diff == 0.0


def test_fast_mode_equals_step_mode_on_a_trace_slice(shared_data: Path) -> None:
    setup = BenchSetup(num_measured=150, max_trace_rows=200, data_dir=str(shared_data))
    _assert_same(setup, Cell("azure-code", "trace", 1.0, "hybrid", 0))


def test_the_fast_mode_leaps_over_steps() -> None:
    """Few clients with long answers: most steps are leapt, so the fast run does less work
    per step; its step count is the step-by-step run's."""
    setup = BenchSetup(num_measured=30)
    step, fast = _both(setup, Cell("default", "closed", 4, "fcfs", 0))
    assert fast.run.stats.num_steps == step.run.stats.num_steps
    assert fast.run.stats.num_leapt_steps > fast.run.stats.num_steps // 2
    assert step.run.stats.num_leapt_steps == 0
    assert compare(step.run.records, fast.run.records).max_rel_diff == 0.0


def test_compare_finds_a_difference() -> None:
    a = {"x": 1.0, "ys": [1, 2], "name": "a"}
    assert compare(a, a).max_rel_diff == 0.0
    assert compare(a, {"x": 1.5, "ys": [1, 2], "name": "a"}).max_rel_diff == pytest.approx(1 / 3)
    assert compare(a, {"x": 1.0, "ys": [1, 2], "name": "b"}).mismatches == 1
    assert compare(a, {"x": 1.0, "ys": [1], "name": "a"}).mismatches >= 1


def test_leap_runs_steady_decodes_up_to_the_step_that_ends_a_request() -> None:
    executor = build_sim_executor("llama-3.1-70b", "a100-80gb", 8)
    clock = VirtualClock()
    engine = Engine(EngineConfig(), "fcfs", executor, clock, fast=True)
    req = Request("r0", list(range(40)), SamplingParams(max_tokens=50, ignore_eos=True), tier=Tier.P1)
    other = Request("r1", list(range(7)), SamplingParams(max_tokens=70, ignore_eos=True), tier=Tier.P1)
    engine.add_request(req)
    engine.add_request(other)
    assert engine.leap(10.0).num_steps == 0  # waiting: the next step must admit them
    engine.step()  # prefill, first tokens
    durations: list[float] = []
    leapt = engine.leap(10.0, durations.append)
    assert leapt.num_steps == 49  # the 50th token ends r0
    assert [o.request for o in leapt.ended] == [req] and req.status.is_final
    assert req.num_output_tokens == 50 and req.finish_time == clock.now()
    assert len(durations) == 49 and all(d > 0 for d in durations)
    # r1 decodes on, kept unwritten; a lookup brings it up to date.
    assert other.num_output_tokens < 50 and engine.get_request("r1") is other
    assert other.num_output_tokens == 50 and other.num_computed_tokens == other.num_tokens - 1
    assert len(other.block_ids) == engine.memory.blocks_for(other.num_tokens - 1)
    engine.memory.check_integrity()
    assert engine.leap(10.0).num_steps == 20 and other.status.is_final


def test_leap_stops_at_the_given_time() -> None:
    executor = build_sim_executor("llama-3.1-70b", "a100-80gb", 8)
    clock = VirtualClock()
    engine = Engine(EngineConfig(), "hybrid", executor, clock, fast=True)
    engine.add_request(Request("r0", [1] * 20, SamplingParams(max_tokens=500, ignore_eos=True)))
    engine.step()
    until = clock.now() + 0.1
    num_steps = engine.leap(until).num_steps
    assert 0 < num_steps < 498
    assert clock.now() >= until > clock.now() - engine.stats.last_step_s


def test_fast_mode_needs_the_simulated_executor() -> None:
    with pytest.raises(ValueError, match="simulated executor"):
        Engine(EngineConfig(), "fcfs", NullExecutor(num_device_blocks=64), VirtualClock(), fast=True)


def _decoding_engine(fast: bool) -> tuple[Engine, VirtualClock, list[Request]]:
    executor = build_sim_executor("llama-3.1-70b", "a100-80gb", 8)
    clock = VirtualClock()
    engine = Engine(EngineConfig(), "hybrid", executor, clock, fast=fast)
    reqs = [
        Request(f"r{i}", list(range(30 + 7 * i)), SamplingParams(max_tokens=90 + i, ignore_eos=True))
        for i in range(6)
    ]
    for req in reqs:
        engine.add_request(req)
    engine.step()  # prefill, first tokens: every request decodes from here
    return engine, clock, reqs


def test_a_leap_cut_by_the_caller_resumes_where_it_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet asks every replica to leap to its next event, again and again: the run is
    built once and resumed, and whoever looks at a request sees the step-by-step state."""
    from tierserve.engine.leap import DecodeLeap

    starts: list[int] = []
    original = DecodeLeap._start
    monkeypatch.setattr(DecodeLeap, "_start", lambda self: starts.append(1) or original(self))
    fast, clock, reqs = _decoding_engine(fast=True)
    num_cuts = 0
    while clock.now() < 1.0:
        leapt = fast.leap(clock.now() + 0.004)  # about a step at a time
        assert leapt.num_steps > 0 and not leapt.ended
        num_cuts += 1
    assert num_cuts > 10 and len(starts) == 1  # one run, resumed at every cut
    # A lookup brings the requests up to date: as step by step at the same number of steps.
    step, step_clock, step_reqs = _decoding_engine(fast=False)
    for _ in range(fast.stats.num_steps - 1):
        step.step()
    assert step_clock.now() == clock.now()
    looked_up = fast.get_request("r3")
    assert looked_up is not None and looked_up.token_ids == step_reqs[3].token_ids
    for a, b in zip(reqs, step_reqs, strict=True):
        assert a.token_ids == b.token_ids and a.num_computed_tokens == b.num_computed_tokens
        assert a.block_ids == b.block_ids
    # Run on to the end both ways: the same outputs and times.
    while fast.has_unfinished():
        if not fast.leap(clock.now() + 0.05).num_steps:
            fast.step()
    step.run_until_done()
    assert [(r.finish_time, r.token_ids) for r in reqs] == [(r.finish_time, r.token_ids) for r in step_reqs]
    fast.memory.check_integrity()


def test_a_kept_leap_refuses_requests_changed_behind_its_back() -> None:
    from tierserve.engine.leap import LeapStateError
    from tierserve.request import FinishReason

    engine, clock, reqs = _decoding_engine(fast=True)
    assert engine.leap(clock.now() + 0.004).num_steps > 0  # cut: the run is kept unwritten
    engine.lifecycle.end(reqs[0], FinishReason.ABORTED)  # not through the engine: no flush
    with pytest.raises(LeapStateError, match="flush first"):
        engine.leap(clock.now() + 0.004)
    # Through the engine an abort writes the run back first.
    engine, clock, reqs = _decoding_engine(fast=True)
    assert engine.leap(clock.now() + 0.004).num_steps > 0
    assert engine.abort("r0") and reqs[1].num_computed_tokens == reqs[1].num_tokens - 1
    assert reqs[1].num_output_tokens == engine.stats.num_steps
    assert engine.leap(clock.now() + 0.004).num_steps > 0


def test_full_steps_keep_the_decoders_and_give_the_step_by_step_results(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admissions, prompt chunks and hybrid's shaped steps (P0 alone, P3 yielding) run
    beside the kept decoders: they are built once, not written out and rebuilt at every
    full step, and the results are still the step-by-step ones."""
    from tierserve.engine.leap import DecodeLeap

    calls: Counter[str] = Counter()
    for name in ("_start", "execute", "_advance_some", "_shift"):
        original = getattr(DecodeLeap, name)

        def counted(self: DecodeLeap, *args: Any, _original: Any = original, _name: str = name) -> Any:
            key = f"{_name}{args[2]:+d}" if _name == "_shift" else _name
            calls[key] += 1
            return _original(self, *args)

        monkeypatch.setattr(DecodeLeap, name, counted)
    _, fast = _assert_same(BenchSetup(num_measured=200), Cell("default", "closed", 64, "hybrid", 3))
    num_full = fast.run.stats.num_steps - fast.run.stats.num_leapt_steps
    assert calls["_start"] <= 2 and calls["execute"] > num_full * 0.9
    assert calls["_advance_some"] > 0 and calls["_shift+1"] > 0  # a few decode, most sit out
    assert calls["_shift-1"] > 0  # a few sit out


def test_a_rank_between_two_adjacent_floats_renumbers_the_running() -> None:
    from tierserve.engine.leap import _rank_between

    a, b, c = (Request(f"r{i}", [1], SamplingParams()) for i in range(3))
    running = [a, c, b]
    ranks = {a: 1.0, b: math.nextafter(1.0, 2.0)}
    assert _rank_between(running, 1, ranks) == 1.0
    assert ranks == {a: 0.0, c: 1.0, b: 2.0}
    assert _rank_between([a, c], 1, {a: 0.0}) == 1.0 and _rank_between([c, a], 0, {a: 0.0}) == -1.0


def _walk_run(fast: bool) -> tuple[VirtualClock, list[Request], Counter[str]]:
    """A long prompt walked in chunks ahead of short requests that decode behind it (vLLM's
    walk, with the base class's chunk cap), then a smaller step budget: the prompt's chunk
    takes the tokens and the decoders behind it sit steps out."""
    from tierserve.engine.leap import DecodeLeap
    from tierserve.scheduling.base import Policy
    from tierserve.scheduling.vllm_priority import VllmPriorityPolicy

    class CappedWalk(VllmPriorityPolicy):
        def prefill_chunk_cap(self, req: Request) -> int | None:
            return Policy.prefill_chunk_cap(self, req)

    walks: Counter[str] = Counter()
    original = DecodeLeap.walk

    def counted(self: DecodeLeap, step: StepBudget) -> bool:
        kept = len(self._kept().decoders)
        taken = original(self, step)
        walks["cut" if taken and len(step.decodes) < kept else str(taken)] += 1
        return taken

    config = EngineConfig()
    limits = replace(
        config.scheduler, max_num_batched_tokens=100, long_prompt_tokens=100, long_prompt_chunk_tokens=64
    )
    config = replace(config, scheduler=limits)
    clock = VirtualClock()
    engine = Engine(
        config, CappedWalk(config), build_sim_executor("llama-3.1-70b", "a100-80gb", 8), clock, fast=fast
    )
    reqs = [Request("long", list(range(3000)), SamplingParams(max_tokens=20, ignore_eos=True), tier=Tier.P1)]
    reqs += [
        Request(f"s{i}", [i] * (10 + i % 7), SamplingParams(max_tokens=40 + i, ignore_eos=True), tier=Tier.P1)
        for i in range(70)
    ]
    for req in reqs:
        engine.add_request(req)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DecodeLeap, "walk", counted)
        for _ in range(20):
            engine.step()
        smaller = replace(config.scheduler, max_num_batched_tokens=50)
        engine.scheduler.config = replace(config, scheduler=smaller)
        while engine.has_unfinished():
            if not engine.leap(clock.now() + 0.05).num_steps:
                engine.step()
    return clock, reqs, walks


def test_vllms_walk_keeps_the_decoders_and_gives_the_step_by_step_results() -> None:
    fast_clock, fast, walks = _walk_run(fast=True)
    step_clock, step, _ = _walk_run(fast=False)
    assert walks["cut"] > 0 and walks["True"] > 0  # decoders behind the prompt sat steps out
    assert fast_clock.now() == step_clock.now()
    assert [(r.finish_time, r.token_ids) for r in fast] == [(r.finish_time, r.token_ids) for r in step]
