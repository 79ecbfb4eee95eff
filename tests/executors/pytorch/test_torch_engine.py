"""Through the real engine: batching, chunked prefill and preemption leave the tokens unchanged."""

from __future__ import annotations

import random

import torch
from torch_checkpoints import Checkpoint

from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig, SchedulerConfig
from tierserve.engine import Engine
from tierserve.executors.pytorch.executor import build_torch_executor
from tierserve.executors.pytorch.sampling import Sampler
from tierserve.request import Request, SamplingParams

LENGTHS = (3, 17, 24, 31)
NUM_TOKENS = 30


def prompts(lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(2, 300) for _ in range(n)] for n in lengths]


def make_engine(
    ckpt: Checkpoint, *, num_blocks: int = 64, sampler: Sampler | None = None, **sched: object
) -> Engine:
    executor, _ = build_torch_executor(
        ckpt.path, dtype=torch.float64, num_device_blocks=num_blocks, num_host_blocks=64, sampler=sampler
    )
    config = EngineConfig(scheduler=SchedulerConfig(**sched))  # type: ignore[arg-type]
    return Engine(config, "fcfs", executor, VirtualClock())


def run(engine: Engine, ps: list[list[int]], **params: object) -> list[list[int]]:
    reqs = [
        Request(f"r{i}", p, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **params))  # type: ignore[arg-type]
        for i, p in enumerate(ps)
    ]
    for r in reqs:
        assert engine.add_request(r), r.reject_reason
    engine.run_until_done(max_steps=10_000)
    engine.memory.check_integrity()
    return [r.output_token_ids for r in reqs]


def preemptions(engine: Engine, reason: str) -> int:
    return sum(n for (_, why), n in engine.stats.preemptions.items() if why == reason)


def test_a_batch_through_the_engine_matches_transformers(checkpoint: Checkpoint) -> None:
    ps = prompts()
    engine = make_engine(checkpoint)
    assert run(engine, ps) == [checkpoint.greedy(p, NUM_TOKENS) for p in ps]
    assert preemptions(engine, "swap") + preemptions(engine, "recompute") == 0


def test_chunked_prefill_matches_transformers(checkpoint: Checkpoint) -> None:
    ps = prompts()
    engine = make_engine(checkpoint, max_num_batched_tokens=6)
    assert run(engine, ps) == [checkpoint.greedy(p, NUM_TOKENS) for p in ps]
    assert engine.stats.num_steps >= sum(LENGTHS) // 6  # the prompts really went in pieces


def test_preemption_by_swap_keeps_tokens_identical(checkpoint: Checkpoint) -> None:
    # 4 requests growing to 4 blocks each share 8 blocks: some must leave mid-generation.
    ps = prompts()
    engine = make_engine(checkpoint, num_blocks=8, swap_factor=1e9)
    assert run(engine, ps) == [checkpoint.greedy(p, NUM_TOKENS) for p in ps]
    assert preemptions(engine, "swap") > 0
    assert preemptions(engine, "recompute") == 0
    assert engine.stats.swap_out_s > 0 and engine.stats.swap_in_s > 0


def test_preemption_by_recompute_keeps_tokens_identical(checkpoint: Checkpoint) -> None:
    ps = prompts()
    engine = make_engine(checkpoint, num_blocks=8, swap_factor=0.0)
    assert run(engine, ps) == [checkpoint.greedy(p, NUM_TOKENS) for p in ps]
    assert preemptions(engine, "recompute") > 0
    assert preemptions(engine, "swap") == 0


def test_seeded_and_unseeded_sampling_survive_recompute(checkpoint: Checkpoint) -> None:
    ps = prompts()
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 50}
    calm = make_engine(checkpoint, sampler=Sampler(salt=5))
    crowded = make_engine(checkpoint, num_blocks=8, swap_factor=0.0, sampler=Sampler(salt=5))
    seeded = run(calm, ps, seed=11, **params)
    assert run(crowded, ps, seed=11, **params) == seeded
    assert preemptions(crowded, "recompute") > 0
    unseeded = run(make_engine(checkpoint, sampler=Sampler(salt=5)), ps, **params)
    crowded = make_engine(checkpoint, num_blocks=8, swap_factor=0.0, sampler=Sampler(salt=5))
    assert run(crowded, ps, **params) == unseeded
    assert seeded != [checkpoint.greedy(p, NUM_TOKENS) for p in ps]  # it really sampled
