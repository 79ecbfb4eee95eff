"""`SimExecutor`: runs no model; predicts each step's duration with the cost model.

It implements the `Executor` protocol, so the same engine, scheduler and memory manager
run against it on a virtual clock. Sampled tokens are placeholders: deterministic ids that
are never one of the model's EOS (or BOS) tokens, so a request ends by its length limit,
by a stop the caller detects, or by abort, exactly as configured.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from tierserve.executors.base import ExecutorSpec, ScheduledSeq, StepBatch, StepResult
from tierserve.executors.sim.cost_model import (
    DEFAULT_ACTIVATION_RESERVE_BYTES,
    CostModel,
    SeqChunk,
    StepCost,
)
from tierserve.executors.sim.gpus import GiB, GpuProfile, get_gpu
from tierserve.model_config import KNOWN_MODELS, ModelConfig

DEFAULT_HOST_SWAP_BYTES_PER_GPU = 64 * GiB  # pinned host memory set aside for swapped K/V, per GPU
PREFILL_MEMO_SIZE = 1 << 16  # estimate_prefill_s answers kept (then forgotten all at once)
SEED_MEMO_SIZE = 1 << 16  # placeholder-token seeds kept, one per request (then forgotten)
READ_AHEAD = 256  # placeholder tokens drawn at once for a request's run (`PlaceholderTokens.tokens`)
# Requests whose drawn run is kept (then forgotten all at once): a few times the running ones,
# about 10 MB. (Kept for every request, 19k requests a replica held 3 GB in a 16-replica fleet.)
AHEAD_MEMO_SIZE = 1024
_blake2b = hashlib.blake2b
_unpack_u64 = struct.Struct("<Q").unpack
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: consecutive positions land far apart
_MIX64 = 0xBF58476D1CE4E5B9  # SplitMix64's first multiplier (Steele, Lea, Flood, OOPSLA 2014)


def get_model(name: str) -> ModelConfig:
    """The model called `name` (case-insensitive), or the one a local Hugging Face model
    directory describes (its config.json, or that file itself; no weights are read). Its
    name is then `name`, so that the path finds it again. ValueError if neither, naming the
    known models, or saying what config.json lacks."""
    model = KNOWN_MODELS.get(name.lower())
    if model is not None:
        return model
    path = Path(name)
    if path.is_dir() or path.is_file():
        from tierserve.executors.pytorch.hf_config import ModelLoadError, parse_hf_config

        config = path / "config.json" if path.is_dir() else path
        try:
            spec = parse_hf_config(config, simulated=True)
        except ModelLoadError as e:
            raise ValueError(str(e)) from None
        if spec.quantization is not None:
            raise ValueError(
                f"{config}: quantized weights ({spec.quantization}) are not modelled: the simulator prices "
                "16-bit weights and K/V"
            )
        # A sliding window caps the context the model attends over (Mistral's 4,096), as the
        # torch executor caps it: the simulator then admits no longer request either. A rope
        # scaling (YaRN, say) stretches it, as vLLM reads it.
        context = spec.max_model_len
        # A float32 checkpoint runs in 16 bits on a GPU: vLLM's dtype "auto" casts it to
        # float16, tierserve's torch executor to bfloat16; the GPU profiles price 16-bit work.
        dtype_bytes = min(spec.config.dtype_bytes, 2)
        return replace(spec.config, name=name, max_position_embeddings=context, dtype_bytes=dtype_bytes)
    raise ValueError(
        f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))}, "
        "or a local model directory with a config.json"
    )


@dataclass(frozen=True, slots=True)
class PlaceholderTokens:
    """Pseudo-random ids from (request_id, position), below the special tokens and never
    EOS/BOS; the model's limits are worked out once (a simulation draws one per token).

    A request's ids come from a 64-bit seed (a BLAKE2b digest of its id, hashed once per
    request) mixed with the position by a SplitMix64-style step: a few integer operations
    a token instead of a digest each."""

    limit: int
    vocab_size: int
    special: frozenset[int]
    _seeds: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    # Each request's latest run of drawn tokens, from its first position (`tokens`).
    _ahead: dict[str, tuple[int, list[int]]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, model: ModelConfig) -> PlaceholderTokens:
        bos = [model.bos_token_id] if model.bos_token_id is not None else []
        # Llama-3's special tokens sit at the top of the vocabulary, from the BOS id up.
        limit = model.bos_token_id if model.bos_token_id is not None else model.vocab_size
        return cls(max(1, limit), model.vocab_size, frozenset([*model.eos_token_ids, *bos]))

    def _seed(self, request_id: str) -> int:
        seeds = self._seeds
        seed = seeds.get(request_id)
        if seed is None:
            if len(seeds) >= SEED_MEMO_SIZE:
                seeds.clear()
            digest = _blake2b(request_id.encode(), digest_size=8).digest()
            seed = seeds[request_id] = _unpack_u64(digest)[0]  # little-endian
        return seed

    def token(self, request_id: str, position: int) -> int:
        """The token sampled for the request when it holds `position` tokens."""
        return self.at(((request_id, position),))[request_id]

    def at(self, positions: Iterable[tuple[str, int]]) -> dict[str, int]:
        """`token` for each (request id, position), by request id (its body inlined: a
        step samples one for every decoding request)."""
        limit, special, vocab_size, seed_of = self.limit, self.special, self.vocab_size, self._seed
        sampled: dict[str, int] = {}
        for request_id, position in positions:
            x = (seed_of(request_id) + position * _GOLDEN64) & _MASK64
            x = ((x ^ (x >> 31)) * _MIX64) & _MASK64
            token = (x ^ (x >> 29)) % limit
            while token in special:
                token = (token + 1) % vocab_size
            sampled[request_id] = token
        return sampled

    def tokens(self, request_id: str, start: int, stop: int) -> list[int]:
        """`token` at each position in [start, stop). A leap reads a request's tokens a
        block at a time as they are needed, so a run of `READ_AHEAD` is drawn at once (in
        numpy) and the next reads are slices of it."""
        ahead = self._ahead
        drawn = ahead.get(request_id)
        if drawn is not None and drawn[0] <= start and stop <= drawn[0] + len(drawn[1]):
            offset = drawn[0]
            return drawn[1][start - offset : stop - offset]
        if len(ahead) >= AHEAD_MEMO_SIZE:
            ahead.clear()
        run = self._draw(self._seed(request_id), start, max(stop, start + READ_AHEAD))
        ahead[request_id] = (start, run)
        return run[: stop - start]

    def _draw(self, seed: int, start: int, stop: int) -> list[int]:
        """`token` at each position in [start, stop) for the request with this seed, the
        same arithmetic on uint64 arrays (whose products wrap modulo 2^64, as the masks do)."""
        with np.errstate(over="ignore"):
            x = np.uint64(seed) + np.arange(start, stop, dtype=np.uint64) * np.uint64(_GOLDEN64)
            x = (x ^ (x >> np.uint64(31))) * np.uint64(_MIX64)
            drawn = (x ^ (x >> np.uint64(29))) % np.uint64(self.limit)
        tokens: list[int] = drawn.tolist()
        special, vocab_size = self.special, self.vocab_size
        # Only a special id below the limit can be drawn (Llama-3's all lie above it):
        # the others need no search, and the search is numpy's.
        reachable = [token for token in special if 0 <= token < self.limit]
        if reachable:
            for i in np.flatnonzero(np.isin(drawn, np.array(reachable, dtype=np.uint64))).tolist():
                token = tokens[i]
                while token in special:
                    token = (token + 1) % vocab_size
                tokens[i] = token
        return tokens


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
        self._prefill_s: dict[tuple[int, int], float] = {}  # estimate_prefill_s's answers
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
        samples: list[tuple[str, int]] = []  # (request, its token count), in the batch's order
        chunks: list[SeqChunk] = []
        # One-token decodes go to the cost model as a count and a summed context, not as
        # chunks (the same figures, see `CostModel.step_cost`).
        num_decodes = decode_context = 0
        decodes = batch.decodes
        for seqs in (decodes, batch.prefills):
            for req, n in seqs:
                computed, num_tokens = req.num_computed_tokens, len(req.token_ids)
                if n == 1 and seqs is decodes:
                    num_decodes += 1
                    decode_context += computed
                else:
                    chunks.append(SeqChunk(n, computed))
                if computed + n == num_tokens:  # ScheduledSeq.samples
                    samples.append((req.request_id, num_tokens))
        sampled = self._tokens.at(samples)
        cost = self.cost.step_cost(chunks, num_decodes, decode_context)
        return StepResult(duration_s=cost.total_s, sampled_token_ids=sampled, roofline_s=cost.roofline_s)

    def execute_beside(
        self, prefills: Sequence[ScheduledSeq], num_decodes: int, decode_context: int
    ) -> StepResult:
        """`execute` for a batch of `prefills` and `num_decodes` one-token decodes over
        `decode_context` cached tokens in all, listed only by count (fast simulation): the
        same duration, and the prefills' samples (the decodes' are `tokens_at`'s)."""
        samples: list[tuple[str, int]] = []
        chunks: list[SeqChunk] = []
        for req, n in prefills:
            computed, num_tokens = req.num_computed_tokens, len(req.token_ids)
            chunks.append(SeqChunk(n, computed))
            if computed + n == num_tokens:
                samples.append((req.request_id, num_tokens))
        cost = self.cost.step_cost(chunks, num_decodes, decode_context)
        sampled = self._tokens.at(samples)
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
        # A pure function of its integers, asked again and again by the scheduler's binary
        # searches over chunk sizes (hybrid's step bound), so remembered.
        key = (num_tokens, num_context_tokens)
        seconds = self._prefill_s.get(key)
        if seconds is None:
            if len(self._prefill_s) >= PREFILL_MEMO_SIZE:
                self._prefill_s.clear()
            seconds = self._prefill_s[key] = self.cost.prefill_s(num_tokens, num_context_tokens)
        return seconds

    def estimate_swap_s(self, num_blocks: int) -> float:
        return self.cost.swap_s(num_blocks, self._spec.block_size)


def build_sim_executor(model_name: str, gpu_name: str, tp: int = 1, **kwargs: Any) -> SimExecutor:
    """`SimExecutor` for a model and GPU named as in `KNOWN_MODELS` / `KNOWN_GPUS`; kwargs pass through."""
    return SimExecutor(get_model(model_name), get_gpu(gpu_name), tp, **kwargs)
