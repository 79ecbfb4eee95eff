"""The paged PyTorch model computes what transformers computes, for each supported variant."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch
from torch_checkpoints import Checkpoint
from torch_paged_runner import greedy_paged, prompt_logits

from tierserve.executors.pytorch.executor import build_torch_executor

PROMPT_LENGTHS = (1, 7, 16, 33)


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 300) for _ in range(n)] for n in lengths]


def build(ckpt: Checkpoint, dtype: torch.dtype = torch.float64, num_blocks: int = 64):
    executor, _ = build_torch_executor(
        ckpt.path, dtype=dtype, num_device_blocks=num_blocks, num_host_blocks=4
    )
    return executor


# Qwen3 in float32 takes RMSNorm's fused path for its query/key norms too.
@pytest.mark.parametrize("variant", [{}, {"arch": "qwen3", "attention_bias": True}], ids=["llama", "qwen3"])
def test_first_step_logits_are_close_to_transformers(
    make_checkpoint: Callable[..., Checkpoint], variant: dict
) -> None:
    checkpoint = make_checkpoint(**variant)
    executor = build(checkpoint, dtype=torch.float32)
    hf32 = checkpoint.hf.to(torch.float32)
    for p in prompts():
        ours = prompt_logits(executor, p)
        with torch.no_grad():
            ref = hf32(torch.tensor([p])).logits[0]
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_equal_transformers_one_prompt_at_a_time(checkpoint: Checkpoint) -> None:
    executor = build(checkpoint)
    for p in prompts():
        assert greedy_paged(executor, [p], 12) == [checkpoint.greedy(p, 12)]


def test_greedy_tokens_equal_transformers_when_batched_and_chunked(checkpoint: Checkpoint) -> None:
    executor = build(checkpoint)
    ps = prompts()
    expected = [checkpoint.greedy(p, 12) for p in ps]
    assert greedy_paged(executor, ps, 12) == expected
    # Chunks of 5 tokens: decodes of short prompts share steps with chunks of long ones.
    assert greedy_paged(executor, ps, 12, chunk=5, seed=3) == expected
    assert len({tuple(e) for e in expected}) > 1, "the model should not say the same thing to every prompt"


class OpenAIPenalties:
    """A transformers logits processor with OpenAI's presence and frequency penalties over
    the generated tokens: the reference for the sampler's."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = scores.clone()
        for row, ids in enumerate(input_ids[:, self.prompt_len :]):
            counts = torch.bincount(ids, minlength=scores.shape[-1]).to(scores.dtype)
            out[row] -= self.frequency * counts + self.presence * (counts > 0)
        return out


@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 1.5), (0.7, 0.4), (-1.0, 0.0)])
def test_greedy_with_penalties_equals_transformers_with_the_same_penalties(
    checkpoint: Checkpoint, presence: float, frequency: float
) -> None:
    from transformers import LogitsProcessorList

    executor = build(checkpoint)
    ps = prompts()
    got = greedy_paged(executor, ps, 16, chunk=5, presence_penalty=presence, frequency_penalty=frequency)
    for p, tokens in zip(ps, got, strict=True):
        penalties = LogitsProcessorList([OpenAIPenalties(len(p), presence, frequency)])
        assert tokens == checkpoint.greedy(p, 16, logits_processor=penalties)
    plain = greedy_paged(executor, ps, 16, chunk=5)
    assert got != plain, "the penalties should change what this model says"


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_greedy_with_a_repetition_penalty_equals_transformers(checkpoint: Checkpoint, penalty: float) -> None:
    """transformers' and vLLM's repetition penalty, over the prompt's tokens and the output's:
    a positive logit divided by it, a negative one multiplied (below 1 it favours repeats)."""
    executor = build(checkpoint)
    ps = prompts()
    got = greedy_paged(executor, ps, 16, chunk=5, repetition_penalty=penalty)
    assert got == [checkpoint.greedy(p, 16, repetition_penalty=penalty) for p in ps]
    assert got != greedy_paged(executor, ps, 16, chunk=5), "the penalty should change what this model says"


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (8, 4), (8, 2), (8, 1)])
def test_grouped_query_attention_matches_for_each_head_ratio(
    make_checkpoint: Callable[..., Checkpoint], num_heads: int, num_kv_heads: int
) -> None:
    ckpt = make_checkpoint(num_heads=num_heads, num_kv_heads=num_kv_heads)
    ps = prompts((5, 21))
    assert greedy_paged(build(ckpt), ps, 8, chunk=8) == [ckpt.greedy(p, 8) for p in ps]


def test_llama3_rope_scaling_matches_beyond_the_original_context(
    make_checkpoint: Callable[..., Checkpoint],
) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    ckpt = make_checkpoint(rope_scaling=scaling)
    executor = build(ckpt)
    assert executor.model.config.rope_scaling is not None
    p = prompts((60,))[0]
    torch.testing.assert_close(prompt_logits(executor, p), ckpt.logits(p), atol=1e-9, rtol=1e-9)
    assert greedy_paged(executor, [p], 10) == [ckpt.greedy(p, 10)]


@pytest.mark.parametrize(
    "variant",
    [
        {"head_dim": 32},  # head_dim other than hidden / heads
        {"tie": True},
        {"arch": "mistral"},
        {"arch": "qwen2"},  # q/k/v biases
        {"arch": "qwen3"},  # per-head query/key RMSNorm, head_dim 128 (transformers' default)
        {"arch": "qwen3", "attention_bias": True},  # and q/k/v/o biases
        {"attention_bias": True},  # Llama: q/k/v/o biases
        {"mlp_bias": True},  # Llama: gate/up/down biases
    ],
    ids=["head_dim", "tied", "mistral", "qwen2", "qwen3", "qwen3-bias", "attention-bias", "mlp-bias"],
)
def test_model_variants_match_transformers(make_checkpoint: Callable[..., Checkpoint], variant: dict) -> None:
    ckpt = make_checkpoint(**variant)
    executor = build(ckpt)
    ps = prompts((9, 26))
    for p in ps:
        torch.testing.assert_close(prompt_logits(executor, p), ckpt.logits(p), atol=1e-9, rtol=1e-9)
    assert greedy_paged(executor, ps, 8, chunk=6) == [ckpt.greedy(p, 8) for p in ps]
