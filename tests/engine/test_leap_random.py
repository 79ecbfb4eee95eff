"""The fast simulation against step-by-step on random operations, in lockstep: requests
of every shape arriving between leaps and steps, aborts, preemptions and lookups, on small
caches and step budgets that force chunking, preemption and swaps. After every operation
both engines must show the same clock, counters and request states; every request's
tokens must match when looked up and at the end."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig
from tierserve.engine import Engine
from tierserve.executors.sim.executor import build_sim_executor, placeholder_token
from tierserve.request import Request, SamplingParams
from tierserve.scheduling import POLICIES
from tierserve.tiers import ALL_TIERS


def _engines(rng: random.Random) -> tuple[Engine, Engine, str]:
    policy = rng.choice(["hybrid", "hybrid", "vllm-priority", *sorted(POLICIES)])
    limits = replace(
        EngineConfig().scheduler,
        max_num_batched_tokens=rng.choice([48, 256, 2048]),
        max_num_seqs=rng.choice([3, 16, 256]),
        enable_prefix_caching=rng.random() < 0.8,
        long_prompt_tokens=rng.choice([64, 8192]),
        long_prompt_chunk_tokens=rng.choice([32, 4096]),
    )
    config = replace(EngineConfig(), scheduler=limits)
    block_size, num_blocks = rng.choice([1, 4, 16]), rng.choice([40, 400, 3000, 3000])
    engines = []
    for fast in (True, False):
        executor = build_sim_executor(
            "llama-3.1-70b", "a100-80gb", 8, block_size=block_size, num_device_blocks=num_blocks
        )
        engines.append(Engine(config, policy, executor, VirtualClock(), fast=fast))
    return engines[0], engines[1], policy


def _request(
    rng: random.Random, index: int, now: float, prefixes: list[list[int]], engine: Engine
) -> Request:
    prompt = rng.choice(prefixes)[: rng.randint(1, 40)] + [
        rng.randint(1, 1000) for _ in range(rng.randint(0, 120))
    ]
    max_tokens = rng.choice([1, 2, rng.randint(3, 40), rng.randint(40, 200)])
    request_id = f"r{index}"
    stop: tuple[int, ...] = ()
    if rng.random() < 0.15:  # a stop token sampled at a chosen output position
        position = len(prompt) + rng.randint(0, max_tokens)
        stop = (placeholder_token(engine.executor.model, request_id, position),)  # type: ignore[attr-defined]
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)
    return Request(request_id, prompt, sampling, tier=rng.choice(ALL_TIERS), arrival_time=now)


def _state(engine: Engine, reqs: list[Request]) -> tuple[object, ...]:
    s = engine.stats
    counters = (s.num_steps, s.num_generated_tokens, s.num_computed_prompt_tokens, s.busy_s, s.roofline_s)
    requests = [
        (
            r.status,
            r.finish_reason,
            r.finish_time,
            r.first_token_time,
            r.num_preemptions,
            [e.kind for e in r.events],
        )
        for r in reqs
    ]
    blocks = [engine.memory.used_blocks(t) for t in ALL_TIERS]
    return (engine.clock.now(), counters, dict(s.preemptions), blocks, engine.waiting_by_tier(), requests)


@pytest.mark.parametrize("seed", range(16))
def test_random_operations_give_the_step_by_step_results(seed: int) -> None:
    rng = random.Random(seed)
    fast, step, policy = _engines(rng)
    prefixes = [[rng.randint(1, 1000) for _ in range(40)] for _ in range(3)]
    fast_reqs: list[Request] = []
    step_reqs: list[Request] = []
    for op in range(250):
        roll = rng.random()
        if roll < 0.3 or not fast_reqs:
            state, burst = rng.getstate(), rng.randint(1, 4)
            for engine, reqs in ((fast, fast_reqs), (step, step_reqs)):
                rng.setstate(state)  # the same requests for both
                for _ in range(burst):
                    req = _request(rng, len(reqs), engine.clock.now(), prefixes, fast)
                    reqs.append(req)
                    engine.add_request(req)
        elif roll < 0.93:
            leapt = fast.leap(fast.clock.now() + rng.expovariate(20.0)).num_steps
            if leapt == 0:
                fast.step()
            for _ in range(max(1, leapt)):
                step.step()
        else:
            request_id = f"r{rng.randrange(len(fast_reqs))}"
            action = rng.choice(["abort", "preempt", "get_request"])
            assert (
                getattr(fast, action)(request_id) == getattr(step, action)(request_id)
                or action == "get_request"
            )
            if action == "get_request":
                a, b = fast.get_request(request_id), step.get_request(request_id)
                assert (a and a.token_ids) == (b and b.token_ids), f"{policy}, op {op}: {request_id}'s tokens"
        assert _state(fast, fast_reqs) == _state(step, step_reqs), f"{policy}, op {op}"
    for _ in range(20_000):  # run both dry, in lockstep
        if not fast.has_unfinished():
            break
        leapt = fast.leap(fast.clock.now() + 0.05).num_steps
        if leapt == 0:
            fast.step()
        for _ in range(max(1, leapt)):
            step.step()
    assert not fast.has_unfinished() and not step.has_unfinished()
    assert _state(fast, fast_reqs) == _state(step, step_reqs)
    assert [r.token_ids for r in fast_reqs] == [r.token_ids for r in step_reqs]
    fast.memory.check_integrity()
