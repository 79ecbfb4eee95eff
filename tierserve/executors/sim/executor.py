"""`SimExecutor`: runs no model; predicts each step's duration with the cost model.

It implements the `Executor` protocol, so the same engine, scheduler and memory manager
run against it on a virtual clock. Sampled tokens are placeholders: deterministic ids that
are never one of the model's EOS (or BOS) tokens, so a request ends by its length limit,
by a stop the caller detects, or by abort, exactly as configured.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tierserve.executors.base import ExecutorSpec, StepBatch, StepResult
from tierserve.executors.sim.cost_model import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    CostModel,
    SeqChunk,
    StepCost,
)
from tierserve.executors.sim.gpus import GiB, GpuProfile, get_gpu
from tierserve.model_config import KNOWN_MODELS, ModelConfig

DEFAULT_HOST_SWAP_BYTES_PER_GPU = 64 * GiB  # pinned host memory set aside for swapped K/V, per GPU


def get_model(name: str) -> ModelConfig:
    """The model called `name` (case-insensitive); ValueError listing the known ones if none is."""
    model = KNOWN_MODELS.get(name.lower())
    if model is None:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}")
    return model


@dataclass(frozen=True, slots=True)
class PlaceholderTokens:
    """Pseudo-random ids from (request_id, position), below the special tokens and never
    EOS/BOS; the model's limits are worked out once (a simulation draws one per token)."""

    limit: int
    vocab_size: int
    special: frozenset[int]

    @classmethod
    def of(cls, model: ModelConfig) -> PlaceholderTokens:
        bos = [model.bos_token_id] if model.bos_token_id is not None else []
        # Llama-3's special tokens sit at the top of the vocabulary, from the BOS id up.
        limit = model.bos_token_id if model.bos_token_id is not None else model.vocab_size
        return cls(max(1, limit), model.vocab_size, frozenset([*model.eos_token_ids, *bos]))

    def token(self, request_id: str, position: int) -> int:
        digest = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=8).digest()
        token = int.from_bytes(digest, "little") % self.limit
        while token in self.special:
            token = (token + 1) % self.vocab_size
        return token

    def tokens(self, request_id: str, start: int, stop: int) -> list[int]:
        """`token` at each position in [start, stop)."""
        return [self.token(request_id, p) for p in range(start, stop)]


def placeholder_token(model: ModelConfig, request_id: str, position: int) -> int:
    """A pseudo-random id from (request_id, position), below the special tokens and never EOS/BOS."""
    return PlaceholderTokens.of(model).token(request_id, position)


class SimExecutor:
    """Implements `Executor` for `model` on `tp` GPUs of kind `gpu`, with predicted timings."""

    def __init__(
        self,
        model: ModelConfig,
        gpu: GpuProfile,
        tp: int = 1,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_device_blocks: int | None = None,
        host_swap_bytes: int = DEFAULT_HOST_SWAP_BYTES_PER_GPU,
        max_model_len: int | None = None,
        activation_reserve_bytes: int = DEFAULT_ACTIVATION_RESERVE_BYTES,
    ) -> None:
        """`num_device_blocks` overrides the count derived from memory; `host_swap_bytes` is per GPU."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.gpu = gpu
        self.tp = tp
        self.cost = CostModel(gpu, model, tp)
        self._tokens = PlaceholderTokens.of(model)
        if num_device_blocks is None:
            capacity = self.cost.kv_capacity_tokens(gpu_memory_utilization, activation_reserve_bytes)
            num_device_blocks = capacity // block_size
        if num_device_blocks < 1:
            raise ValueError(
                f"{model.name} on {tp} x {gpu.name} leaves no memory for the K/V cache "
                f"(gpu_memory_utilization={gpu_memory_utilization})"
            )
        block_bytes_per_gpu = block_size * self.cost.kv_bytes_per_token_per_gpu
        max_len = min(model.max_position_embeddings, num_device_blocks * block_size)
        if max_model_len is not None:
            max_len = min(max_len, max_model_len)
        self._spec = ExecutorSpec(
            block_size=block_size,
            num_device_blocks=num_device_blocks,
            num_host_blocks=host_swap_bytes // block_bytes_per_gpu,
            max_model_len=max_len,
            kv_bytes_per_block=block_size * self.cost.kv_bytes_per_token,  # across all tp GPUs
            eos_token_ids=model.eos_token_ids,
        )

    @property
    def spec(self) -> ExecutorSpec:
        return self._spec

    def execute(self, batch: StepBatch) -> StepResult:
        chunks = [SeqChunk(s.num_tokens, s.start) for s in batch.seqs]
        cost = self.cost.step_cost(chunks)
        token = self._tokens.token
        sampled = {
            s.request.request_id: token(s.request.request_id, s.request.num_tokens)
            for s in batch.seqs
            if s.samples
        }
        return StepResult(duration_s=cost.total_s, sampled_token_ids=sampled, roofline_s=cost.roofline_s)

    def decode_step_cost(self, num_seqs: int, num_context_tokens: int) -> StepCost:
        """What `execute` predicts for `num_seqs` one-token decodes over `num_context_tokens`
        cached tokens in all (fast simulation: no batch to build)."""
        return self.cost.decode_step_cost(num_seqs, num_context_tokens)

    def tokens_at(self, request_id: str, start: int, stop: int) -> list[int]:
        """The tokens `execute` samples for the request when it holds start, start + 1, ...
        stop - 1 tokens."""
        return self._tokens.tokens(request_id, start, stop)

    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> float:
        return self.estimate_swap_s(len(mapping))

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> float:
        return self.estimate_swap_s(len(mapping))

    def estimate_prefill_s(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        return self.cost.prefill_s(num_tokens, num_context_tokens)

    def estimate_swap_s(self, num_blocks: int) -> float:
        return self.cost.swap_s(num_blocks, self._spec.block_size)


def build_sim_executor(model_name: str, gpu_name: str, tp: int = 1, **kwargs: Any) -> SimExecutor:
    """`SimExecutor` for a model and GPU named as in `KNOWN_MODELS` / `KNOWN_GPUS`; kwargs pass through."""
    return SimExecutor(get_model(model_name), get_gpu(gpu_name), tp, **kwargs)
