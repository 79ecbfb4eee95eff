"""SGLang's `--enable-priority-scheduling` (the second baseline), after SGLang's
scheduler (`PrefillAdder.preempt_to_schedule` in srt/managers/schedule_policy.py).

- The waiting queue is in priority order, first come first served within a priority.
- A waiting request may preempt running ones only when its priority exceeds theirs by
  more than `preemption_threshold` (SGLang's `--priority-scheduling-preemption-threshold`,
  default 10). It does so when no seat is free (`max_num_seqs`) or its blocks do not fit;
  victims are the lowest priority first, newest first, and only if the victims it may
  take free enough memory — otherwise nothing is preempted (SGLang checks the token sum
  before it preempts).
- Preemption is by recompute (SGLang retracts a request to the waiting queue); one
  shared pool, no tier reservations, no aging.

Tiers become SGLang priorities (larger = more urgent, SGLang's default sign):
P0 = 3 × spacing, P1 = 2 × spacing, P2 = spacing, P3 = 0, with `tier_spacing` 10 by
default. With SGLang's default threshold of 10, one tier of difference (10) does not
exceed it and two do: P0 preempts P2 and P3, P1 preempts P3, and adjacent tiers never
preempt each other — the hysteresis the threshold exists for. Both numbers are settings
(`[policy.sglang-priority]`).

What differs from SGLang: SGLang runs prefill batches and decode batches separately
(mixed chunked prefill is optional) and reserves decode room for running requests with
its `new_token_ratio`; here the engine mixes decodes and prefill chunks in every step as
for every policy, and a running request short of a block for its next token preempts
the lowest-priority, newest running request (SGLang's retraction picks by output length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from tierserve.config import ConfigError, EngineConfig, PolicyOptions
from tierserve.request import Request
from tierserve.scheduling.priority_heap import HeapPolicy
from tierserve.tiers import ALL_TIERS, Tier

if TYPE_CHECKING:
    from tierserve.memory.manager import KVCacheManager


@dataclass(frozen=True)
class SglangOptions(PolicyOptions):
    preemption_threshold: int = 10  # SGLang's --priority-scheduling-preemption-threshold
    tier_spacing: int = 10  # SGLang priority of tier t: (3 - t) * tier_spacing

    def check(self, path: str) -> None:
        if self.preemption_threshold < 0:
            raise ConfigError(f"{path}.preemption_threshold: must be >= 0, got {self.preemption_threshold}")
        if self.tier_spacing < 1:
            raise ConfigError(f"{path}.tier_spacing: must be >= 1, got {self.tier_spacing}")


class SglangPriorityPolicy(HeapPolicy):
    name: ClassVar[str] = "sglang-priority"
    leaps_decodes: ClassVar[bool] = True  # no step hooks; peek on an empty queue changes nothing
    leaps_while_waiting: ClassVar[bool] = True
    tiered_memory: ClassVar[bool] = False
    allow_swap: ClassVar[bool] = False
    options_type: ClassVar[type[PolicyOptions] | None] = SglangOptions

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.options = config.options(self.name, SglangOptions)

    def sglang_priority(self, tier: Tier) -> int:
        return (len(ALL_TIERS) - 1 - tier) * self.options.tier_spacing

    def outranks(self, req: Request, victim: Request) -> bool:
        """SGLang's rule: preempt only past the threshold."""
        gap = self.sglang_priority(req.tier) - self.sglang_priority(victim.tier)
        return gap > self.options.preemption_threshold

    def preempts_for_admission(self, req: Request, memory: KVCacheManager, num_blocks: int) -> bool:
        return True  # victims are filtered by `admission_victim_ok`

    def preempts_for_seat(self, req: Request) -> bool:
        return True

    def admission_victim_ok(self, req: Request, victim: Request, memory: KVCacheManager) -> bool:
        return self.outranks(req, victim)

    def victim_key(self, victim: Request, borrowed: Sequence[int]) -> tuple[float, ...]:
        return (-victim.tier, -victim.arrival_time)  # lowest priority, newest first
