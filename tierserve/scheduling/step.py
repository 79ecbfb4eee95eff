"""The step under construction: its token and seat budget, the work chosen so far, and
the preemptions and swaps that go with it.

The scheduler carries one `StepBudget` through the phases of a pass (running requests,
swap-ins, prefill chunks, admissions), the way mini-sglang's `PrefillAdder` carries its
budget through admission; policy hooks read and shape it (`Policy.begin_step` may cap
some tiers' prefill tokens, `Policy.end_step` may take work out of the step).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from tierserve.request import Request
from tierserve.tiers import Tier


class PreemptMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass
class StepBudget:
    tokens_left: int  # of max_num_batched_tokens
    seats: int  # max_num_seqs
    decodes: dict[Request, int] = field(default_factory=dict)  # request -> 1, in scheduling order
    prefills: dict[Request, int] = field(default_factory=dict)  # request -> chunk tokens
    preempted: list[tuple[Request, PreemptMode]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    fresh: set[Request] = field(default_factory=set)  # admitted or swapped in this pass: no victims
    # The executor's predicted duration of a step of n tokens (for hooks that bound steps).
    estimate_s: Callable[[int], float] | None = None
    # A shared cap on the prefill tokens of some tiers in this step (set by a policy hook).
    capped_tiers: frozenset[Tier] = frozenset()
    capped_tokens_left: int = 0

    def cap_prefill(self, tiers: Collection[Tier], num_tokens: int) -> None:
        """Let the prefill chunks of `tiers` take at most `num_tokens` of this step together."""
        self.capped_tiers = frozenset(tiers)
        self.capped_tokens_left = max(0, num_tokens)

    def chunk_for(self, req: Request, cap: int | None = None) -> int:
        """How many of `req`'s uncomputed tokens fit in this step (`cap`: the policy's own)."""
        n = min(req.num_tokens - req.num_computed_tokens, self.tokens_left)
        if req.tier in self.capped_tiers:
            n = min(n, self.capped_tokens_left)
        return n if cap is None else min(n, cap)

    def has_prefill_room(self, tier: Tier) -> bool:
        """Whether a prompt of `tier` could get any token in this step."""
        return self.tokens_left >= 1 and (tier not in self.capped_tiers or self.capped_tokens_left >= 1)

    def add_decode(self, req: Request) -> None:
        self.decodes[req] = 1
        self.tokens_left -= 1

    def add_prefill(self, req: Request, num_tokens: int) -> None:
        self.prefills[req] = num_tokens
        self.tokens_left -= num_tokens
        if req.tier in self.capped_tiers:
            self.capped_tokens_left -= num_tokens

    def give_back(self, req: Request) -> int:
        """Take `req`'s work out of the step (a victim, or shaping); returns the tokens freed."""
        n = self.decodes.pop(req, 0) + self.prefills.pop(req, 0)
        self.tokens_left += n
        return n

    def drop_where(self, tiers: Collection[Tier], *, decodes: bool, prefills: bool) -> None:
        """Leave the decodes and/or prefill chunks of `tiers` out of this step (shaping: the
        tokens are not handed back, since the step is already built)."""
        for work, on in ((self.decodes, decodes), (self.prefills, prefills)):
            if on:
                for req in [r for r in work if r.tier in tiers]:
                    del work[req]

    def tiers_prefilling(self) -> set[Tier]:
        return {r.tier for r in self.prefills}

    def has_work(self, tier: Tier, *, decodes: bool, prefills: bool) -> bool:
        return (decodes and any(r.tier == tier for r in self.decodes)) or (
            prefills and any(r.tier == tier for r in self.prefills)
        )
