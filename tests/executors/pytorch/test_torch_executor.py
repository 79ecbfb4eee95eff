"""The executor's contract with the engine: spec, measured estimates, step results."""

from __future__ import annotations

import math

import pytest
import torch
from torch_paged_runner import prompt_logits

from tierserve.executors.base import ScheduledSeq, StepBatch
from tierserve.executors.pytorch.executor import build_torch_executor
from tierserve.executors.pytorch.sampling import SampleRequest
from tierserve.model_config import DEMO_MODEL
from tierserve.request import Request, SamplingParams


@pytest.fixture(scope="module")
def demo():
    return build_torch_executor("demo", num_device_blocks=32, num_host_blocks=8)


def test_spec_describes_the_pools_and_model(demo) -> None:
    executor, tokenizer = demo
    spec = executor.spec
    assert (spec.block_size, spec.num_device_blocks, spec.num_host_blocks) == (16, 32, 8)
    assert spec.kv_bytes_per_block == 16 * DEMO_MODEL.kv_bytes_per_token  # float32, like the config says
    assert spec.max_model_len == 32 * 16  # capped by what the pool can hold
    assert spec.eos_token_ids == tokenizer.eos_token_ids == (257,)


def test_kv_budget_in_bytes_sets_the_block_count() -> None:
    executor, _ = build_torch_executor("demo", kv_cache_bytes=(1 << 20) + 5, num_host_blocks=0)
    assert executor.spec.num_device_blocks == (1 << 20) // executor.spec.kv_bytes_per_block
    assert math.isinf(executor.estimate_swap_s(1))  # no host pool: swapping is never cheaper
    with pytest.raises(ValueError):
        build_torch_executor("demo", kv_cache_bytes=1 << 20, num_device_blocks=4)


def test_estimates_come_from_measurements_and_scale_with_size(demo) -> None:
    executor, _ = demo
    assert 0 < executor.estimate_prefill_s(100) < executor.estimate_prefill_s(1000) < 60
    assert 0 < executor.estimate_swap_s(1) < executor.estimate_swap_s(10) < 60
    assert executor.estimate_swap_s(0) == 0


def test_execute_samples_only_where_a_chunk_reaches_the_end(demo) -> None:
    executor, tokenizer = demo
    a = Request("a", tokenizer.encode("hello there"), SamplingParams(max_tokens=4))
    b = Request("b", tokenizer.encode("a longer prompt, in two chunks"), SamplingParams(max_tokens=4))
    a.block_ids, b.block_ids = [3], [7, 1, 9]
    result = executor.execute(StepBatch(prefills=[ScheduledSeq(a, a.num_tokens), ScheduledSeq(b, 10)]))
    assert set(result.sampled_token_ids) == {"a"}
    assert 0 <= result.sampled_token_ids["a"] < DEMO_MODEL.vocab_size
    assert result.duration_s > 0 and result.roofline_s == 0.0


def test_execute_refuses_tokens_beyond_the_request(demo) -> None:
    executor, tokenizer = demo
    r = Request("r", tokenizer.encode("hi"), SamplingParams())
    r.block_ids = [0]
    with pytest.raises(ValueError):
        executor.execute(StepBatch(prefills=[ScheduledSeq(r, r.num_tokens + 1)]))
    r.block_ids = []
    with pytest.raises(ValueError):
        executor.execute(StepBatch(prefills=[ScheduledSeq(r, r.num_tokens)]))


def test_demo_weights_are_the_same_in_every_executor(demo) -> None:
    executor, _ = demo
    other, _ = build_torch_executor("demo", num_device_blocks=2, num_host_blocks=0)
    a, b = executor.model.state_dict(), other.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sampling_is_keyed_by_the_requests_output_index(demo) -> None:
    executor, tokenizer = demo
    prompt = tokenizer.encode("resumed after preemption")
    generated = [65, 66, 67]
    reference = build_torch_executor("demo", num_device_blocks=8, num_host_blocks=0)[0]
    logits = None
    same_as_index_0 = []
    for seed in range(6):
        params = SamplingParams(max_tokens=8, temperature=3.0, seed=seed)
        r = Request(f"s{seed}", prompt, params)
        r.token_ids.extend(generated)  # three tokens out: the next one is output index 3
        r.block_ids = [4, 5]
        token = executor.execute(StepBatch(prefills=[ScheduledSeq(r, r.num_tokens)])).sampled_token_ids[
            r.request_id
        ]
        if logits is None:
            logits = prompt_logits(reference, r.token_ids)[-1:]
        expect = executor.sampler.sample(logits, [SampleRequest(r.request_id, params, 3)])[0]
        assert token == expect
        same_as_index_0.append(
            token == executor.sampler.sample(logits, [SampleRequest(r.request_id, params, 0)])[0]
        )
    assert not all(same_as_index_0)
