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

# A step's predicted duration in seconds from its tokens and their mean context.
StepEstimate = Callable[[int, int], float]


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
    # The executor's predicted duration of one step that prefills n tokens after ctx cached
    # tokens, as estimate_s(n, ctx) (for hooks that bound steps).
    estimate_s: StepEstimate | None = None
    # A shared cap on the prefill tokens of some tiers in this step (set by a policy hook),
    # counted in tokens of a fresh prompt: a chunk deep into a long prompt also pays for
    # attention over its context, so it is charged the fresh tokens that cost as much.
    capped_tiers: frozenset[Tier] = frozenset()
    capped_tokens_left: int = 0
    capped_at_least: int = 1  # pricing at the context never cuts a chunk below this
    # The summed context (computed tokens) of `decodes`, where the fast simulation keeps it
    # (its decoding requests' counts are brought up to date only when read one by one);
    # None: sum them (`decode_context_tokens`). Any change to `decodes` drops it.
    decode_context: int | None = None

    def cap_prefill(self, tiers: Collection[Tier], num_tokens: int, *, at_least: int = 1) -> None:
        """Let the prefill chunks of `tiers` take at most `num_tokens` of this step together,
        priced at their context when `estimate_s` is known (but each chunk gets at least
        `at_least` tokens while the cap has them, so that long prompts keep moving)."""
        self.capped_tiers = frozenset(tiers)
        self.capped_tokens_left = max(0, num_tokens)
        self.capped_at_least = max(1, at_least)

    def chunk_for(self, req: Request, cap: int | None = None) -> int:
        """How many of `req`'s uncomputed tokens fit in this step (`cap`: the policy's own)."""
        n = min(req.num_tokens - req.num_computed_tokens, self.tokens_left)
        if req.tier in self.capped_tiers:
            n = self.capped_chunk(req, self.capped_tokens_left, n)
        return n if cap is None else min(n, cap)

    def capped_chunk(
        self, req: Request, capped_tokens: int, most: int | None = None, *, at_least: bool = True
    ) -> int:
        """How many of `req`'s uncomputed tokens (at most `most`) a cap of `capped_tokens`
        fresh tokens holds, priced at `req`'s context, but `capped_at_least` (unless not
        `at_least`: then never more than the cap holds)."""
        n = req.num_tokens - req.num_computed_tokens if most is None else most
        n = min(n, max(0, capped_tokens))
        context = req.num_computed_tokens
        if n > 1 and context and self.estimate_s is not None:
            bound_s = self.estimate_s(capped_tokens, 0)
            fit = tokens_at_context_within(self.estimate_s, n, context, bound_s)
            n = max(fit, min(n, self.capped_at_least)) if at_least else fit
        return n

    def has_prefill_room(self, tier: Tier) -> bool:
        """Whether a prompt of `tier` could get any token in this step."""
        return self.tokens_left >= 1 and (tier not in self.capped_tiers or self.capped_tokens_left >= 1)

    def add_decode(self, req: Request) -> None:
        self.decodes[req] = 1
        self.tokens_left -= 1
        self.decode_context = None

    def add_decodes(self, requests: Collection[Request]) -> None:
        """`add_decode` for each of `requests` (distinct), in one go."""
        self.decodes.update(dict.fromkeys(requests, 1))
        self.tokens_left -= len(requests)
        self.decode_context = None

    def decode_context_tokens(self) -> int:
        """The computed tokens the step's decodes attend over, in all."""
        if self.decode_context is not None:
            return self.decode_context
        return sum(r.num_computed_tokens for r in self.decodes)

    def add_prefill(self, req: Request, num_tokens: int) -> None:
        self.prefills[req] = num_tokens
        self.tokens_left -= num_tokens
        if req.tier in self.capped_tiers:
            self.capped_tokens_left -= self._fresh_tokens(num_tokens, req.num_computed_tokens)

    def _fresh_tokens(self, num_tokens: int, context: int) -> int:
        """The tokens of a fresh prompt that cost as much as `num_tokens` after `context`
        (at most what the cap has left)."""
        left = self.capped_tokens_left
        if not context or self.estimate_s is None or num_tokens >= left:
            return min(num_tokens, left)
        estimate, cost = self.estimate_s, self.estimate_s(num_tokens, context)
        lo, hi = num_tokens, left  # the smallest fresh count in [lo, hi] costing >= cost
        while lo < hi:
            mid = (lo + hi) // 2
            if estimate(mid, 0) >= cost:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def give_back(self, req: Request) -> int:
        """Take `req`'s work out of the step (a victim, or shaping); returns the tokens freed."""
        n = self.decodes.pop(req, 0) + self.prefills.pop(req, 0)
        self.tokens_left += n
        self.decode_context = None
        return n

    def drop_where(self, tiers: Collection[Tier], *, decodes: bool, prefills: bool) -> None:
        """Leave the decodes and/or prefill chunks of `tiers` out of this step (shaping: the
        tokens are not handed back, since the step is already built)."""
        if decodes:
            self.decode_context = None
        for work, on in ((self.decodes, decodes), (self.prefills, prefills)):
            if on:
                for req in [r for r in work if r.tier in tiers]:
                    del work[req]

    def drop_prefills(self, requests: Collection[Request]) -> None:
        """Leave these requests' prefill chunks out of this step (shaping, as `drop_where`)."""
        for req in requests:
            self.prefills.pop(req, None)

    def tiers_prefilling(self) -> set[Tier]:
        return {r.tier for r in self.prefills}

    def has_work(self, tier: Tier, *, decodes: bool, prefills: bool) -> bool:
        return (decodes and any(r.tier == tier for r in self.decodes)) or (
            prefills and any(r.tier == tier for r in self.prefills)
        )


def tokens_at_context_within(estimate_s: StepEstimate, most: int, context: int, bound_s: float) -> int:
    """The largest chunk of up to `most` tokens after `context` computed ones whose predicted
    time is within `bound_s` (1 if none is): a chunk deep into a prompt reads every token
    before it, so it gets fewer tokens than a fresh one."""
    if estimate_s(most, context) <= bound_s:  # the whole chunk fits
        return most
    return tokens_within(lambda n: estimate_s(n, context), bound_s, most)


def tokens_within(estimate_s: Callable[[int], float], bound_s: float, most: int) -> int:
    """The largest token count in [1, most] whose predicted step time is within `bound_s`
    (1 if none is; binary search, `estimate_s` grows with the tokens)."""
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate_s(mid) <= bound_s:
            lo = mid
        else:
            hi = mid - 1
    return lo
