"""Counters the engine keeps while it runs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tierserve.tiers import Tier


@dataclass
class EngineStats:
    num_steps: int = 0
    num_leapt_steps: int = 0  # of num_steps, run by the fast simulation's leaps
    num_kept_steps: int = 0  # of num_steps, full steps run beside the fast simulation's kept decoders
    num_generated_tokens: int = 0
    num_computed_prompt_tokens: int = 0  # prefill tokens actually computed (cache hits excluded)
    preemptions: Counter[tuple[Tier, str]] = field(default_factory=Counter)  # (victim tier, swap|recompute)
    swap_out_s: float = 0.0
    swap_in_s: float = 0.0
    busy_s: float = 0.0  # time spent in steps and swaps
    roofline_s: float = 0.0  # sum of the executor's lower bounds for the same steps
    num_finished: int = 0
    num_rejected: int = 0
    num_aborted: int = 0
    num_shed: Counter[Tier] = field(default_factory=Counter)  # by tier; reasons are on the requests
    last_step_tokens: int = 0
    last_step_seqs: int = 0
    last_step_s: float = 0.0
    last_schedule_cpu_s: float = 0.0  # CPU time of the last scheduling pass, if Engine.time_schedule

    def num_preemptions(self, reason: str | None = None) -> int:
        return sum(n for (_, r), n in self.preemptions.items() if reason is None or r == reason)
