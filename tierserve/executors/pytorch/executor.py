"""`TorchExecutor`: runs engine steps on a real model over the paged K/V pool."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tierserve.executors.base import ExecutorSpec, StepBatch, StepResult
from tierserve.executors.pytorch.attention import SeqSpan, build_metadata
from tierserve.executors.pytorch.calibrate import Calibration, calibrate
from tierserve.executors.pytorch.kv_pool import KVLayout, KVPool
from tierserve.executors.pytorch.loader import free_bytes, load_model
from tierserve.executors.pytorch.model import CausalLM
from tierserve.executors.pytorch.sampling import Sampler, SampleRequest
from tierserve.executors.pytorch.tokenizer import Tokenizer
from tierserve.executors.pytorch.workspace import Workspace
from tierserve.request import SamplingDefaults

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_BYTES = 256 << 20
DEFAULT_GPU_KV_FRACTION = 0.5  # of the memory free once the weights are loaded
MAX_DEFAULT_HOST_BYTES = 4 << 30
CPU_DECODE_GROUP = 8  # sequences per decode attention call on a CPU (attention.py says why)


class TorchExecutor:
    """Implements the `Executor` protocol with a `CausalLM` and a `KVPool`."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        *,
        max_model_len: int,
        context_note: str = "",
        sampler: Sampler | None = None,
        eos_token_ids: Sequence[int] = (),
        sampling_defaults: SamplingDefaults | None = None,
    ):
        """`context_note`: why `max_model_len` is below the model's positions (its sliding
        window), said in every refusal for length."""
        self.model = model
        self.pool = pool
        self.device = pool.device
        self.sampler = sampler or Sampler()
        self.eos_token_ids = tuple(eos_token_ids)
        bs = pool.layout.block_size
        pool_tokens = pool.num_device_blocks * bs
        if pool_tokens < max_model_len:
            context_note = f" (the KV cache holds {pool_tokens} tokens)"
        self._spec = ExecutorSpec(
            block_size=bs,
            num_device_blocks=pool.num_device_blocks,
            num_host_blocks=pool.num_host_blocks,
            max_model_len=min(max_model_len, pool_tokens),
            kv_bytes_per_block=pool.layout.bytes_per_block,
            eos_token_ids=self.eos_token_ids,
            context_note=context_note,
            sampling_defaults=sampling_defaults or SamplingDefaults(),
        )
        self._workspace = Workspace()
        self._decode_group = CPU_DECODE_GROUP if self.device.type == "cpu" else None
        self.calibration: Calibration = calibrate(model, pool)

    @property
    def spec(self) -> ExecutorSpec:
        return self._spec

    def execute(self, batch: StepBatch) -> StepResult:
        start = time.perf_counter()
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        samples: list[SampleRequest] = []
        spans: list[SeqSpan] = []
        # Decodes by context length, so that each decode attention group pads little.
        decodes = sorted(batch.decodes, key=lambda s: s.start) if self._decode_group else batch.decodes
        for seq in decodes + batch.prefills:
            req = seq.request
            end = seq.start + seq.num_tokens
            if seq.num_tokens < 1 or end > req.num_tokens or end > self._spec.max_model_len:
                raise ValueError(
                    f"request {req.request_id}: cannot compute tokens [{seq.start}, {end}) "
                    f"of {req.num_tokens} (max_model_len {self._spec.max_model_len})"
                )
            spans.append(SeqSpan(seq.start, seq.num_tokens, req.block_ids))
            ids.extend(req.token_ids[seq.start : end])
            positions.extend(range(seq.start, end))
            if seq.samples:
                rows.append(len(ids) - 1)
                penalized, repeats = req.sampling.penalized, req.sampling.repetition_penalty != 1.0
                samples.append(
                    SampleRequest(
                        req.request_id,
                        req.sampling,
                        req.num_output_tokens,
                        req.output_token_ids if penalized else (),
                        req.prompt_token_ids if repeats else (),
                    )
                )
        if not ids:
            return StepResult(duration_s=time.perf_counter() - start, sampled_token_ids={})
        num_decodes = len(batch.decodes)
        with torch.inference_mode():
            meta = build_metadata(
                spans[:num_decodes],
                spans[num_decodes:],
                self._spec.block_size,
                self.device,
                self._workspace,
                self._decode_group,
                self.pool.layout.dtype,
            )
            logits = self.model(
                torch.tensor(ids, device=self.device),
                torch.tensor(positions, device=self.device),
                meta,
                self.pool,
                torch.tensor(rows, dtype=torch.long, device=self.device),
            )
            tokens = self.sampler.sample(logits, samples) if samples else []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sampled = {r.request_id: t for r, t in zip(samples, tokens, strict=True)}
        return StepResult(duration_s=time.perf_counter() - start, sampled_token_ids=sampled)

    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> float:
        return self.pool.swap_out(mapping)

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> float:
        return self.pool.swap_in(mapping)

    def estimate_prefill_s(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        # The start-up calibration times fresh prompts only: a chunk is priced by its tokens.
        return self.calibration.prefill_s(num_tokens)

    def estimate_swap_s(self, num_blocks: int) -> float:
        return self.calibration.swap_s(num_blocks)


def _device_blocks(layout: KVLayout, device: torch.device, kv_cache_bytes: int | None) -> int:
    if kv_cache_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_bytes = int(free * DEFAULT_GPU_KV_FRACTION)
        else:
            kv_cache_bytes = DEFAULT_CPU_KV_BYTES
        return layout.blocks_for_bytes(kv_cache_bytes)
    room = free_bytes(device)
    if room is not None and kv_cache_bytes > room:  # else torch's traceback, once the model had loaded
        raise ValueError(
            f"a K/V cache of {kv_cache_bytes / (1 << 30):.3g} GiB is more than the "
            f"{room / (1 << 30):.3g} GiB free on {device.type}"
        )
    return layout.blocks_for_bytes(kv_cache_bytes)


def build_torch_executor(
    model: str | Path = "demo",
    device: str | torch.device = "cpu",
    *,
    kv_cache_bytes: int | None = None,
    num_device_blocks: int | None = None,
    num_host_blocks: int | None = None,
    dtype: torch.dtype | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    sampler: Sampler | None = None,
) -> tuple[TorchExecutor, Tokenizer]:
    """Load `model` ("demo" or a local Hugging Face directory) and size its K/V pools.

    The device pool has `num_device_blocks` blocks, or as many as `kv_cache_bytes` holds
    (default: 256 MiB on CPU, half the free memory on CUDA). The host swap pool defaults
    to as many blocks as the device pool, at most 4 GiB.
    """
    if kv_cache_bytes is not None and num_device_blocks is not None:
        raise ValueError("give kv_cache_bytes or num_device_blocks, not both")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this torch build sees no CUDA device")
    loaded = load_model(model, dev, dtype)
    config = loaded.model.config
    weights = loaded.model.model.embed_tokens.weight
    layout = KVLayout(
        config.num_hidden_layers, config.num_key_value_heads, config.head_size, block_size, weights.dtype
    )
    if num_device_blocks is None:
        num_device_blocks = _device_blocks(layout, dev, kv_cache_bytes)
    if num_host_blocks is None:
        num_host_blocks = min(num_device_blocks, MAX_DEFAULT_HOST_BYTES // layout.bytes_per_block)
    pool = KVPool(layout, num_device_blocks, num_host_blocks, dev)
    executor = TorchExecutor(
        loaded.model,
        pool,
        max_model_len=loaded.max_model_len,
        context_note=loaded.context_note,
        sampler=sampler,
        eos_token_ids=loaded.tokenizer.eos_token_ids,
        sampling_defaults=loaded.sampling_defaults,
    )
    return executor, loaded.tokenizer
