"""A trivial executor for tests and overhead benchmarks: a linear step-time model and
deterministic placeholder tokens. It records every batch it was given."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tierserve.executors.base import ExecutorSpec, StepBatch, StepResult


class NullExecutor:
    def __init__(
        self,
        num_device_blocks: int = 1024,
        num_host_blocks: int = 1024,
        block_size: int = 16,
        max_model_len: int = 32768,
        step_s: float = 0.01,
        per_token_s: float = 1e-5,
        swap_block_s: float = 1e-4,
        token_id: int = 7,
        eos_token_ids: tuple[int, ...] = (),
        on_execute: Callable[[StepBatch], None] | None = None,
    ) -> None:
        self._spec = ExecutorSpec(
            block_size=block_size,
            num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks,
            max_model_len=max_model_len,
            kv_bytes_per_block=block_size * 1024,
            eos_token_ids=eos_token_ids,
        )
        self.step_s = step_s
        self.per_token_s = per_token_s
        self.swap_block_s = swap_block_s
        self.token_id = token_id
        self.on_execute = on_execute
        self.batches: list[StepBatch] = []
        self.swapped_out: list[tuple[int, int]] = []
        self.swapped_in: list[tuple[int, int]] = []
        self.record = True

    @property
    def spec(self) -> ExecutorSpec:
        return self._spec

    def execute(self, batch: StepBatch) -> StepResult:
        if self.record:
            self.batches.append(batch)
        if self.on_execute is not None:
            self.on_execute(batch)
        sampled = {s.request.request_id: self.token_id for s in batch.seqs if s.samples}
        duration = self.step_s + self.per_token_s * batch.num_tokens
        return StepResult(duration, sampled, roofline_s=duration / 2)

    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> float:
        self.swapped_out.extend(mapping)
        return self.estimate_swap_s(len(mapping))

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> float:
        self.swapped_in.extend(mapping)
        return self.estimate_swap_s(len(mapping))

    def estimate_prefill_s(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        return self.step_s + self.per_token_s * num_tokens

    def estimate_swap_s(self, num_blocks: int) -> float:
        return self.swap_block_s * num_blocks
