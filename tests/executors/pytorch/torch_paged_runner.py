"""Drive a TorchExecutor without the engine: a fixed block table per request, in scrambled block order."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from tierserve.executors.base import ScheduledSeq, StepBatch
from tierserve.executors.pytorch.attention import SeqSpan, build_metadata
from tierserve.executors.pytorch.executor import TorchExecutor
from tierserve.request import Request, SamplingParams


def greedy_paged(
    executor: TorchExecutor,
    prompts: Sequence[list[int]],
    num_tokens: int,
    *,
    chunk: int = 10_000,
    seed: int = 0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
) -> list[list[int]]:
    """Generate `num_tokens` per prompt, all prompts in every step (prefill chunks and decodes mixed)."""
    bs = executor.spec.block_size
    free = list(range(executor.spec.num_device_blocks))
    random.Random(seed).shuffle(free)
    reqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(
            max_tokens=num_tokens,
            ignore_eos=True,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
        )
        req = Request(f"r{i}", list(p), params)
        req.block_ids = [free.pop() for _ in range(-(-(len(p) + num_tokens) // bs))]
        reqs.append(req)
    while any(r.num_output_tokens < num_tokens for r in reqs):
        decodes, prefills = [], []
        for r in reqs:
            if r.num_output_tokens >= num_tokens:
                continue
            if r.num_output_tokens == 0:
                prefills.append(ScheduledSeq(r, min(chunk, r.num_tokens - r.num_computed_tokens)))
            else:
                decodes.append(ScheduledSeq(r, 1))
        result = executor.execute(StepBatch(decodes, prefills))
        for seq in decodes + prefills:
            sampled = seq.samples
            seq.request.num_computed_tokens += seq.num_tokens
            if sampled:
                seq.request.token_ids.append(result.sampled_token_ids[seq.request.request_id])
    return [r.output_token_ids for r in reqs]


def prompt_logits(executor: TorchExecutor, prompt: list[int]) -> torch.Tensor:
    """Logits at every position of `prompt`, from one prefill into blocks 0, 1, ..."""
    bs = executor.spec.block_size
    n = len(prompt)
    span = SeqSpan(0, n, list(range(-(-n // bs))))
    dev = executor.device
    with torch.inference_mode():
        meta = build_metadata([], [span], bs, dev)
        return executor.model(
            torch.tensor(prompt, device=dev),
            torch.arange(n, device=dev),
            meta,
            executor.pool,
            torch.arange(n, device=dev),
        ).cpu()
