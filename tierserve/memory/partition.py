"""How the block pool is divided between tiers, in blocks.

The partition is accounting, not separate memory: all tiers draw from one pool.
  * floor   — hard-isolated: blocks only this tier or a more urgent one may use;
  * reserve — elastic: others may borrow it while idle; borrowed blocks are reclaimed
              by preempting the borrower;
  * ceiling — the most blocks the tier may hold;
  * the rest is shared, first come first served.
A tier's usage counts against its floor, then its reserve, then the shared remainder;
beyond that it is borrowing, and the least urgent tiers are deemed the borrowers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from tierserve.config import TierConfig
from tierserve.tiers import ALL_TIERS, Tier


def share_of(share: float, num_blocks: int) -> int:
    """The whole blocks a share of the pool comes to, rounded down, but not below a whole
    number by floating point's error: 0.57 x 100 is 56.999..., and a share asked for as
    "at least 0.570" gave 56 blocks, one short."""
    return math.floor(share * num_blocks + 1e-9)


@dataclass(frozen=True)
class TierPartition:
    num_blocks: int
    floor: tuple[int, ...]
    reserve: tuple[int, ...]
    ceiling: tuple[int, ...]

    @classmethod
    def flat(cls, num_blocks: int) -> TierPartition:
        """No isolation at all: every tier may use every block."""
        n = len(ALL_TIERS)
        return cls(num_blocks, (0,) * n, (0,) * n, (num_blocks,) * n)

    @classmethod
    def from_tiers(cls, num_blocks: int, tiers: Mapping[Tier, TierConfig]) -> TierPartition:
        floor = tuple(share_of(tiers[t].floor, num_blocks) for t in ALL_TIERS)
        reserve = tuple(share_of(tiers[t].reserve, num_blocks) for t in ALL_TIERS)
        ceiling = tuple(max(share_of(tiers[t].ceiling, num_blocks), floor[t] + reserve[t]) for t in ALL_TIERS)
        return cls(num_blocks, floor, reserve, ceiling)

    @property
    def num_shared(self) -> int:
        return self.num_blocks - sum(self.floor) - sum(self.reserve)

    def entitlement(self, tier: Tier) -> int:
        """Blocks the tier may take back from borrowers: its floor plus its reserve."""
        return self.floor[tier] + self.reserve[tier]

    def max_blocks(self, tier: Tier) -> int:
        """The most blocks the tier can ever hold: its ceiling, less more urgent floors."""
        return min(self.ceiling[tier], self.num_blocks - sum(self.floor[:tier]))

    def protected_free(self, tier: Tier, used: list[int]) -> int:
        """Free blocks `tier` must leave alone: unfilled floors of more urgent tiers."""
        protected, floor = 0, self.floor
        for u in range(tier):  # a loop, not sum(max(...)): asked for every allocation
            if floor[u] > used[u]:
                protected += floor[u] - used[u]
        return protected

    def borrowed(self, used: list[int]) -> list[int]:
        """Blocks each tier holds beyond its floor, reserve and the shared pool."""
        over = [max(0, used[t] - self.floor[t] - self.reserve[t]) for t in ALL_TIERS]
        excess = max(0, sum(over) - self.num_shared)
        borrowed = [0] * len(ALL_TIERS)
        for t in reversed(ALL_TIERS):  # least urgent tiers are the borrowers
            take = min(over[t], excess)
            borrowed[t] = take
            excess -= take
        return borrowed
