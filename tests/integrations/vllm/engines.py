"""Real vLLM (CPU build) engines on a tiny checkpoint the tests write, driven step by step.

The engine core runs in the test's process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so one
`step()` is one scheduling step and the scheduler's state can be read between steps.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from vllm import LLM, SamplingParams

from tierserve.integrations.vllm.checkpoint import write_tiny_llama

BLOCK_SIZE = 32
NUM_BLOCKS = 64  # vLLM keeps one as its null block
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers * (K, V) * kv heads * head_dim * float32
MAX_NUM_SEQS = 8
PLUGIN = "tierserve.integrations.vllm.TierScheduler"


def checkpoint(root: Path) -> Path:
    return write_tiny_llama(root / "tiny-llama")


def make_llm(
    model: Path,
    *,
    scheduler_cls: str | None,
    policy: str = "fcfs",
    prefix_caching: bool = True,
    max_model_len: int = 512,
    max_num_batched_tokens: int = 512,
    **extra: Any,
) -> LLM:
    kw: dict[str, Any] = dict(extra)
    if scheduler_cls is not None:
        kw["scheduler_cls"] = scheduler_cls
    return LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_SIZE * KV_BYTES_PER_TOKEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=max_num_batched_tokens,
        scheduling_policy=policy,
        enable_prefix_caching=prefix_caching,
        enforce_eager=True,
        seed=0,
        **kw,
    )


def write_lora(root: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter for `checkpoint`'s model (q and v projections), in PEFT's layout."""
    import json

    import torch
    from safetensors.torch import save_file

    folder = root / f"lora-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0}
    config |= {"target_modules": ["q_proj", "v_proj"], "bias": "none", "task_type": "CAUSAL_LM"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(2):
        for module, out in (("q_proj", 4 * 32), ("v_proj", 2 * 32)):  # heads x head_dim
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, 128, generator=gen) * 0.1
            weights[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.1
    save_file(weights, str(folder / "adapter_model.safetensors"))
    return folder


def scheduler_of(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def prompt(seed: int, length: int) -> list[int]:
    """A prompt of distinct tokens per seed (no accidental prefix-cache sharing)."""
    return [2 + (seed * 7919 + i * 104729) % 297 for i in range(length)]


@dataclass
class Driver:
    """Submits requests, steps the engine, and records what each request got, per step."""

    llm: LLM
    plugin: bool
    step_no: int = 0
    submitted_at: dict[str, int] = field(default_factory=dict)
    first_token_step: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: Counter[str] = field(default_factory=Counter)

    def submit(
        self, rid: str, ids: list[int], max_tokens: int, tier: int, lora: Any = None, **xargs: Any
    ) -> None:
        extra = {"tier": f"P{tier}", **xargs} if self.plugin else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
        priority = 0 if self.plugin else tier
        self.llm.llm_engine.add_request(
            rid, {"prompt_token_ids": ids}, params, priority=priority, lora_request=lora
        )
        self.submitted_at[rid] = self.step_no

    def step(self) -> None:
        self.step_no += 1
        for out in self.llm.llm_engine.step():
            rid = out.request_id
            ids = list(out.outputs[0].token_ids) if out.outputs else []
            if ids and rid not in self.first_token_step:
                self.first_token_step[rid] = self.step_no
            self.tokens[rid] = ids
            if out.finished:
                self.finished[rid] += 1

    def run(self, max_steps: int, until: Any = None) -> None:
        """Step until `until()` holds or nothing is left (bounded by `max_steps`)."""
        for _ in range(max_steps):
            if until is not None and until():
                return
            if until is None and not self.llm.llm_engine.has_unfinished_requests():
                return
            self.step()
        raise AssertionError(f"still running after {max_steps} steps")

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def abort(self, rids: list[str]) -> None:
        self.llm.llm_engine.abort_request(rids)

    def abort_rest(self) -> None:
        """Abort whatever is still running and step until the engine is idle."""
        rest = [rid for rid in self.submitted_at if not self.finished[rid]]
        if rest:
            self.abort(rest)
        self.run(200)

    def ttft_steps(self, rid: str) -> int:
        return self.first_token_step[rid] - self.submitted_at[rid]
