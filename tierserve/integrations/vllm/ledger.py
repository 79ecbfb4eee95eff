"""Per-tier KV block accounting over vLLM's block pool, by tierserve's partition rules.

vLLM's pool has no notion of tiers; the ledger counts the blocks each tier's requests hold
and turns `TierPartition` (floors, reserves, ceilings, borrowing) into the one lever vLLM's
`KVCacheManager.allocate_slots` offers: a number of free blocks the allocation must leave
alone. It also answers the two questions tierserve's policies ask about memory
(`within_entitlement`, `is_borrowing`), so the policies run unchanged.

A block shared by several requests (a prefix-cache hit) counts once, for the most urgent
tier among its holders: the counts add up to the blocks in use, never past the pool.
"""

from __future__ import annotations

import math

from tierserve.config import ConfigError
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

    def reserved_blocks(self, tier: Tier, num_free: int, also: int = 0) -> int:
        """Free blocks an allocation for `tier` must leave: the unfilled floors of more
        urgent tiers, and whatever lies beyond the tier's ceiling. `also`: blocks the caller
        itself leaves free (vLLM's reserve for prompts whose KV loads asynchronously): they
        add to the floors, which are the pool's too, but not to the ceiling, which bounds the
        tier's own blocks alone."""
        protected = self.partition.protected_free(tier, self.used)
        headroom = max(0, self.partition.ceiling[tier] - self.used[tier])
        return max(also + protected, num_free - headroom)

    def ceiling_binds(self, tier: Tier, num_free: int, also: int = 0) -> bool:
        """Whether an allocation for `tier` that found too few blocks was held back by the
        tier's ceiling (`also` as for `reserved_blocks`). Then no other tier's blocks would
        make room (the part held back grows with every block they free); only blocks of
        `tier` itself would."""
        headroom = max(0, self.partition.ceiling[tier] - self.used[tier])
        return num_free - headroom >= also + self.partition.protected_free(tier, self.used)

    def fits(self, tier: Tier, num_blocks: int, num_free: int) -> bool:
        return num_blocks <= num_free - self.reserved_blocks(tier, num_free)

    def borrowed(self) -> list[int]:
        return self.partition.borrowed(self.used)

    # The two memory questions tierserve's policies ask (see scheduling/base.py).
    def within_entitlement(self, tier: Tier, num_new_blocks: int) -> bool:
        return self.used[tier] + num_new_blocks <= self.partition.entitlement(tier)

    def is_borrowing(self, tier: Tier) -> bool:
        return self.borrowed()[tier] > 0


def tier_turned_off(tier: Tier) -> ConfigError:
    """tierserve's engine refuses the requests of a tier whose ceiling is 0; vLLM's scheduler
    cannot refuse a request, and they would wait forever."""
    return ConfigError(
        f"tiers.{tier.name}.ceiling: 0 turns a tier off in tierserve's own engine, but the plug-in "
        "cannot refuse a request (it would wait forever): give the tier a ceiling, lowering the "
        "floors of the more urgent tiers to leave it room"
    )


def check_room_for_one_request(partition: TierPartition, num_blocks_needed: int, max_model_len: int) -> None:
    """Raise `ConfigError` unless every tier may hold the `num_blocks_needed` blocks of one
    request of `max_model_len` tokens: a longer request of a tier that may hold fewer would
    never be admitted (or, grown past it, never come back), and in vLLM it would hold up
    every request queued behind it."""
    if num_blocks_needed > partition.num_blocks:  # no tier setting can help: the pool itself is short
        raise ConfigError(
            f"vLLM's {partition.num_blocks} KV blocks are fewer than the {num_blocks_needed} one request "
            f"of --max-model-len {max_model_len} tokens needs (such a request would wait forever): "
            "lower --max-model-len (or --watermark) or give vLLM more KV cache memory"
        )
    for tier in ALL_TIERS:
        most = partition.max_blocks(tier)
        if most >= num_blocks_needed:
            continue
        if partition.ceiling[tier] == 0:  # a share that rounds to no block
            raise tier_turned_off(tier)
        share = math.ceil(1000 * num_blocks_needed / partition.num_blocks) / 1000  # enough, rounded up
        if partition.ceiling[tier] == most:
            raise ConfigError(
                f"tiers.{tier.name}.ceiling: {tier.name} may hold {most} of vLLM's {partition.num_blocks} "
                f"KV blocks, fewer than the {num_blocks_needed} one request of --max-model-len "
                f"{max_model_len} tokens needs (such a request would wait forever): raise the ceiling "
                f"to at least {share:.3f} or lower --max-model-len"
            )
        urgent = "+".join(f"tiers.{u.name}.floor" for u in ALL_TIERS[:tier] if partition.floor[u])
        raise ConfigError(
            f"{urgent}: the floors of the tiers more urgent than {tier.name} leave it {most} of vLLM's "
            f"{partition.num_blocks} KV blocks, fewer than the {num_blocks_needed} one request of "
            f"--max-model-len {max_model_len} tokens needs (such a request would wait forever): "
            "lower the floors or --max-model-len"
        )
