"""A pool of fixed-size KV-cache blocks with reference counts and a prefix cache.

Invariant: every block is in exactly one of three states —
  * in use:      ref_count > 0, charged to exactly one tier;
  * cached-free: ref_count == 0, holds a full block whose hash is in the prefix cache,
                 kept in its tier's LRU until evicted (lowest tier first);
  * free:        ref_count == 0, no hash, on the free list.
`num_free` counts cached-free and free blocks: both can be handed out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tierserve.tiers import ALL_TIERS, Tier

NO_TIER = -1


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of a full block, chained with its parent's so equal hashes mean equal prefixes."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.charged_tier = [NO_TIER] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.used_by_tier = [0] * len(ALL_TIERS)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields low ids first
        self._hash_to_block: dict[int, int] = {}
        # Cached-free blocks per tier that last held them, least recently used first.
        self._evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in ALL_TIERS]
        self._num_evictable = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + self._num_evictable

    @property
    def num_cached_free(self) -> int:
        return self._num_evictable

    def lookup(self, block_hash: int) -> int | None:
        return self._hash_to_block.get(block_hash)

    def take(self, block_id: int, tier: Tier) -> None:
        """Add a reference to a cached block (a prefix-cache hit)."""
        if self.ref_count[block_id] == 0:
            self._evictable[self.charged_tier[block_id]].pop(block_id)
            self._num_evictable -= 1
            self.charged_tier[block_id] = tier
            self.used_by_tier[tier] += 1
        self.ref_count[block_id] += 1

    def allocate(self, tier: Tier) -> int:
        """Hand out one block for `tier`; the caller has checked `num_free`."""
        block_id = self._free.pop() if self._free else self._evict_one()
        self.ref_count[block_id] = 1
        self.charged_tier[block_id] = tier
        self.used_by_tier[tier] += 1
        return block_id

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached-free (if hashed) or free."""
        count = self.ref_count[block_id] - 1
        if count < 0:
            raise AssertionError(f"block {block_id} released more often than taken")
        self.ref_count[block_id] = count
        if count:
            return
        tier = self.charged_tier[block_id]
        self.used_by_tier[tier] -= 1
        if self.block_hash[block_id] is None:
            self.charged_tier[block_id] = NO_TIER
            self._free.append(block_id)
        else:
            self._evictable[tier][block_id] = None  # most recently used at the end
            self._num_evictable += 1

    def register(self, block_id: int, block_hash: int) -> None:
        """Record that `block_id` now holds the full block `block_hash` (first writer wins)."""
        if self.block_hash[block_id] is not None or block_hash in self._hash_to_block:
            return
        self.block_hash[block_id] = block_hash
        self._hash_to_block[block_hash] = block_id

    def _evict_one(self) -> int:
        for lru in reversed(self._evictable):  # P3's blocks go first
            if lru:
                block_id, _ = lru.popitem(last=False)
                self._num_evictable -= 1
                block_hash = self.block_hash[block_id]
                assert block_hash is not None, "an evictable block always has a hash"
                del self._hash_to_block[block_hash]
                self.block_hash[block_id] = None
                self.charged_tier[block_id] = NO_TIER
                return block_id
        raise AssertionError("allocate() called with no free block")

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        evictable: set[int] = set()
        for tier, lru in enumerate(self._evictable):
            for b in lru:
                assert b not in evictable, f"block {b} is evictable twice"
                assert self.charged_tier[b] == tier, f"evictable block {b} filed under the wrong tier"
                evictable.add(b)
        assert len(evictable) == self._num_evictable, "evictable count drifted"
        assert not free & evictable, "a block is both free and cached-free"
        used = [0] * len(ALL_TIERS)
        for b in range(self.num_blocks):
            refs = self.ref_count[b]
            if refs > 0:
                assert b not in free and b not in evictable, f"block {b} is in use and free"
                assert self.charged_tier[b] != NO_TIER, f"block {b} is in use but charged to no tier"
                used[self.charged_tier[b]] += 1
            else:
                assert refs == 0, f"block {b} has a negative reference count"
                assert (b in free) != (b in evictable), f"block {b} is lost"
                if b in free:
                    assert self.block_hash[b] is None, f"free block {b} still has a hash"
                else:
                    assert self.block_hash[b] is not None, f"cached block {b} has no hash"
            h = self.block_hash[b]
            if h is not None:
                assert self._hash_to_block.get(h) == b, f"block {b}'s hash is not indexed"
        assert len(self._hash_to_block) == sum(h is not None for h in self.block_hash), "stale hashes"
        assert used == self.used_by_tier, f"per-tier usage drifted: {used} != {self.used_by_tier}"
