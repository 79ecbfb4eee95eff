"""Per-tier KV block accounting over vLLM's block pool, by tierserve's partition rules.

vLLM's pool has no notion of tiers; the ledger counts the blocks each tier's requests hold
and turns `TierPartition` (floors, reserves, ceilings, borrowing) into the one lever vLLM's
`KVCacheManager.allocate_slots` offers: a number of free blocks the allocation must leave
alone. It also answers the two questions tierserve's policies ask about memory
(`within_entitlement`, `is_borrowing`), so the policies run unchanged.

A block shared by several requests (a prefix-cache hit) counts once for each holder.
"""

from __future__ import annotations

from tierserve.memory.partition import TierPartition
from tierserve.tiers import ALL_TIERS, Tier


class LedgerError(RuntimeError):
    """The ledger's counts went negative: a free was recorded for blocks never held."""


class TierLedger:
    def __init__(self, partition: TierPartition) -> None:
        self.partition = partition
        self.used = [0] * len(ALL_TIERS)

    def reset(self, used: list[int]) -> None:
        if len(used) != len(ALL_TIERS) or min(used) < 0:
            raise LedgerError(f"bad per-tier usage {used}")
        self.used = list(used)

    def add(self, tier: Tier, num_blocks: int) -> None:
        self.used[tier] += num_blocks
        if self.used[tier] < 0:
            raise LedgerError(f"{tier.name} would hold {self.used[tier]} blocks")

    def release(self, tier: Tier, num_blocks: int) -> None:
        """Blocks freed between recounts. Clamped at zero: the count is rebuilt from vLLM's
        pool at every step, and blocks vLLM frees late (deferred frees) may already be out."""
        self.used[tier] = max(0, self.used[tier] - num_blocks)

    def reserved_blocks(self, tier: Tier, num_free: int) -> int:
        """Free blocks an allocation for `tier` must leave: the unfilled floors of more
        urgent tiers, and whatever lies beyond the tier's ceiling."""
        protected = self.partition.protected_free(tier, self.used)
        headroom = max(0, self.partition.ceiling[tier] - self.used[tier])
        return max(protected, num_free - headroom)

    def fits(self, tier: Tier, num_blocks: int, num_free: int) -> bool:
        return num_blocks <= num_free - self.reserved_blocks(tier, num_free)

    def borrowed(self) -> list[int]:
        return self.partition.borrowed(self.used)

    # The two memory questions tierserve's policies ask (see scheduling/base.py).
    def within_entitlement(self, tier: Tier, num_new_blocks: int) -> bool:
        return self.used[tier] + num_new_blocks <= self.partition.entitlement(tier)

    def is_borrowing(self, tier: Tier) -> bool:
        return self.borrowed()[tier] > 0
