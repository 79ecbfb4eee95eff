"""The policy vLLM users get today with `--scheduling-policy priority` (the baseline),
written after vLLM V1's scheduler (vllm/v1/core/sched/scheduler.py).

What it does as vLLM does:
- the waiting queue is a heap on (priority, arrival); a tier is the priority;
- the running list stays in admission order and is walked once per pass, decodes and
  prefill chunks alike, under the step's token budget;
- when a running request cannot get blocks, the running request with the largest
  (priority, arrival) is preempted by recompute, possibly the requester itself, which
  ends the walk; a victim already scheduled in this pass gives its tokens back;
- a pass that preempted admits nothing; admission stops at the first waiting request
  that does not fit (no preemption for a waiting request, however urgent);
- no aging, no memory reservations (one shared pool), no swap, no cap on a long
  prompt's chunk (vLLM's `long_prefill_token_threshold` is 0 by default).

What still differs from vLLM: the prefix cache and its block accounting are tierserve's
(freed last block first and evicted in one LRU order, as vLLM's); there is no speculative
decoding, no structured-output or LoRA limits, no encoder budget and no async scheduling;
preempted requests rejoin the waiting queue at the end of the pass rather than the moment
they are preempted (no admission happens in that pass either way); a request that would
exceed the model length is rejected at submission rather than truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from tierserve.request import Request
from tierserve.scheduling.base import RunningPass
from tierserve.scheduling.priority_heap import HeapPolicy


class VllmPriorityPolicy(HeapPolicy):
    name: ClassVar[str] = "vllm-priority"
    tiered_memory: ClassVar[bool] = False
    allow_swap: ClassVar[bool] = False
    running_pass: ClassVar[RunningPass] = RunningPass.ADMISSION_ORDER
    admits_after_preemption: ClassVar[bool] = False
    leaps_decodes: ClassVar[bool] = True  # no hooks
    leaps_while_waiting: ClassVar[bool] = True

    def victim_key(self, victim: Request, borrowed: Sequence[int]) -> tuple[float, ...]:
        return (-victim.tier, -victim.arrival_time)  # the largest (priority, arrival) first

    def prefill_chunk_cap(self, req: Request) -> int | None:
        return None
