"""The seam between the engine and whatever runs the model.

The engine hands an executor one `StepBatch` per iteration and gets back a `StepResult`.
`sim` predicts how long the step would take on a real GPU; `torch` runs a real model.
Block ids in a batch index the executor's device KV pool; swap mappings pair device
block ids with host block ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import NamedTuple, Protocol, cast

from tierserve.request import Request, SamplingDefaults


class ScheduledSeq(NamedTuple):
    """Compute `num_tokens` tokens of `request`, starting at `request.num_computed_tokens`."""

    request: Request
    num_tokens: int

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the last known token, so a new token is sampled."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


def decode_seqs(requests: Iterable[Request]) -> list[ScheduledSeq]:
    """`ScheduledSeq(r, 1)` for each of `requests`, made by `tuple.__new__` as the
    NamedTuple's own constructor does, but without a Python call per tuple (a step has
    one for every decoding request)."""
    make = cast(Callable[[type[ScheduledSeq], tuple[Request, int]], ScheduledSeq], tuple.__new__)
    return list(map(make, repeat(ScheduledSeq), zip(requests, repeat(1))))


@dataclass(frozen=True, slots=True)
class StepBatch:
    decodes: list[ScheduledSeq] = field(default_factory=list)  # one token each
    prefills: list[ScheduledSeq] = field(default_factory=list)  # prompt (or recompute) chunks

    @property
    def seqs(self) -> list[ScheduledSeq]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(s.num_tokens for s in self.prefills)

    def __len__(self) -> int:
        return len(self.decodes) + len(self.prefills)


@dataclass(frozen=True, slots=True)
class StepResult:
    duration_s: float  # how long the step took (measured) or would take (predicted)
    sampled_token_ids: dict[str, int]  # request_id -> new token, for seqs whose chunk `samples`
    roofline_s: float = 0.0  # lower bound on the step's time from peak FLOPs and bandwidth


@dataclass(frozen=True, slots=True)
class ExecutorSpec:
    """What the engine must know about the executor's memory and model."""

    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    kv_bytes_per_block: int
    eos_token_ids: tuple[int, ...] = ()  # a sampled EOS ends a request unless it ignores EOS
    # Why max_model_len is below the model's positions, to end a refusal with (e.g. " (its
    # sliding_window: ...)"); "" where it is not.
    context_note: str = ""
    # The model's own sampling settings (generation_config.json), for what a request leaves out.
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)

    def context_said(self) -> str:
        """ "the model's context of N tokens", and why where it is not the model's positions."""
        return f"the model's context of {self.max_model_len} tokens{self.context_note}"


class Executor(Protocol):
    @property
    def spec(self) -> ExecutorSpec: ...

    def execute(self, batch: StepBatch) -> StepResult:
        """Run one forward step over the batch and sample where `ScheduledSeq.samples`."""
        ...

    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> float:
        """Copy (device_block, host_block) pairs to host memory; return seconds taken."""
        ...

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> float:
        """Copy (host_block, device_block) pairs back to the device; return seconds taken."""
        ...

    def estimate_prefill_s(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        """Predicted time of one step that prefills `num_tokens` of a prompt after
        `num_context_tokens` already cached (0: from scratch, as for swap-vs-recompute)."""
        ...

    def estimate_swap_s(self, num_blocks: int) -> float:
        """Predicted time to move `num_blocks` over the host link, one direction."""
        ...
