"""A pool of fixed-size KV-cache blocks with reference counts and a prefix cache.

Invariant: every block is in exactly one of three states —
  * in use:      ref_count > 0, charged to exactly one tier;
  * cached-free: ref_count == 0, holds a full block whose hash is in the prefix cache,
                 kept in an LRU list until evicted (P0's last: `_lru`);
  * free:        ref_count == 0, no hash, on the free list.
`num_free` counts cached-free and free blocks: both can be handed out.

Prefix-cache keys are SHA-256 digests chained through the parent's key (as vLLM's): equal
keys mean equal prefixes unless SHA-256 is broken. A hit is also checked against the block's
own tokens and its parent's key, so a key shared by two blocks of different contents (a
weak `hash_fn`, as tests inject) costs a miss. That check does not reach further back: with
a weak hash, a block computed after one parent can be a hit for another parent of the same
key (the first evicted, the second cached since), so only a collision-resistant key makes
every hit the prefix's own KV.

A request's `cache_salt` (vLLM's field) keys its first block after a root key made from the
salt, where an unsalted request's first block has no parent: requests share cached blocks
only with requests of the same salt (the server salts each tenant's requests apart). The
root is the first block's recorded parent too, so the check on a hit tells salts apart.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from itertools import islice

from tierserve.memory.errors import KVIntegrityError
from tierserve.tiers import ALL_TIERS, Tier

NO_TIER = -1
BlockKey = bytes
_sha256 = hashlib.sha256
HashFn = Callable[[BlockKey | None, Sequence[int]], BlockKey]


def hash_block(parent_key: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
    """SHA-256 over the parent's key (none for a first block) and the block's token ids."""
    digest = hashlib.sha256(parent_key or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def salt_key(cache_salt: str | None) -> BlockKey | None:
    """The parent key of a request's first block: none without a salt (the keys stay those of
    an unsalted prompt), else SHA-256 of the salt under a tag of its own."""
    if cache_salt is None:
        return None
    return hashlib.sha256(b"tierserve cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()


_PACKERS: dict[int, Callable[..., bytes]] = {}  # number of ids -> its `_ids_bytes` packer


def _ids_bytes(token_ids: Sequence[int]) -> bytes:
    """`array("q", token_ids).tobytes()`, the same bytes ("=": native order, 8 bytes an id)
    in a third of the time: struct takes the ids as arguments, array item by item."""
    n = len(token_ids)
    pack = _PACKERS.get(n)
    if pack is None:
        if len(_PACKERS) >= 4096:  # one a length: a few hundred lengths in any run
            _PACKERS.clear()
        pack = _PACKERS[n] = struct.Struct(f"={n}q").pack
    try:
        return pack(*token_ids)
    except struct.error:  # an id out of range: array's error, as before
        return array("q", token_ids).tobytes()


def hash_blocks(parent_key: BlockKey | None, token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """`hash_block` of each full block of `token_ids` in turn, each chained to the key
    before it (the ids are converted to bytes once for all the blocks)."""
    data = _ids_bytes(token_ids)
    stride = block_size * 8  # bytes of one block's ids ("q": 8 bytes each)
    keys: list[BlockKey] = []
    parent = parent_key or b""
    for offset in range(0, len(token_ids) // block_size * stride, stride):
        parent = _sha256(parent + data[offset : offset + stride]).digest()
        keys.append(parent)
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, evict_by_tier: bool = True) -> None:
        """`evict_by_tier`: P0's cached blocks are evicted last, the other tiers' before them
        in one least-recently-used order; without it all in that one order, as vLLM's pool
        (the policies that share one pool: a tier's label then changed which prefixes
        survived). Evicting P3's, then P2's, then P1's first, as the tiers' order went,
        cost the light loads' goodput 0.3 % in prefix misses and gave P0 nothing more."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.charged_tier = [NO_TIER] * num_blocks
        self.block_hash: list[BlockKey | None] = [None] * num_blocks
        # What each cached block holds, to check a hit: (parent's key, its own token ids).
        self._content: list[tuple[BlockKey | None, tuple[int, ...]] | None] = [None] * num_blocks
        self.num_key_collisions = 0  # lookups whose key matched a block holding something else
        self.used_by_tier = [0] * len(ALL_TIERS)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() yields low ids first
        self._hash_to_block: dict[BlockKey, int] = {}
        # Cached-free blocks, least recently used first: P0's, then the other tiers' (all in
        # the first list without `evict_by_tier`: `_lru_index`); emptied last list first.
        self._evictable: list[OrderedDict[int, None]] = [OrderedDict(), OrderedDict()]
        self._num_evictable = 0
        self._by_tier = evict_by_tier
        self._lru_of_tier = [self._evictable[self._lru_index(t)] for t in ALL_TIERS]

    def _lru(self, tier: int) -> OrderedDict[int, None]:
        """The list a cached-free block last held by `tier` waits in."""
        return self._lru_of_tier[tier]

    def _lru_index(self, tier: int) -> int:
        """P0's list (the first) is emptied last; every other tier's blocks share the second
        (and every tier's the first, without `evict_by_tier`)."""
        return 1 if self._by_tier and tier != 0 else 0

    @property
    def num_free(self) -> int:
        return len(self._free) + self._num_evictable

    @property
    def num_free_uncached(self) -> int:
        """Free blocks that hold nothing cached: handed out before any eviction."""
        return len(self._free)

    @property
    def num_cached_free(self) -> int:
        return self._num_evictable

    def lookup(
        self,
        block_hash: BlockKey,
        parent: BlockKey | None,
        token_ids: Sequence[int],
        evicted: AbstractSet[int] = frozenset(),
    ) -> int | None:
        """The cached block with this key, if it holds exactly `token_ids` after `parent`
        (and is not among `evicted`: blocks taken as if evicted already)."""
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None or block_id in evicted:
            return None
        if self._content[block_id] != (parent, tuple(token_ids)):
            self.num_key_collisions += 1
            return None
        return block_id

    def take(self, block_id: int, tier: Tier) -> None:
        """Add a reference to a cached block (a prefix-cache hit)."""
        if self.ref_count[block_id] == 0:
            self._lru(self.charged_tier[block_id]).pop(block_id)
            self._num_evictable -= 1
            self.charged_tier[block_id] = tier
            self.used_by_tier[tier] += 1
        self.ref_count[block_id] += 1

    def allocate(self, tier: Tier) -> int:
        """Hand out one block for `tier`; the caller has checked `num_free`."""
        block_id = self._free.pop() if self._free else self._evict(1)[0]
        self.ref_count[block_id] = 1
        self.charged_tier[block_id] = tier
        self.used_by_tier[tier] += 1
        return block_id

    def allocate_many(self, tier: Tier, num_blocks: int) -> list[int]:
        """`allocate` `num_blocks` times, in one go: the same blocks in the same order (the
        free list's end first, then evictions); the caller has checked `num_free`."""
        free = self._free
        num_from_free = min(num_blocks, len(free))
        block_ids = free[len(free) - num_from_free :]
        del free[len(free) - num_from_free :]
        block_ids.reverse()  # pop() order
        if num_blocks > num_from_free:
            block_ids.extend(self._evict(num_blocks - num_from_free))
        ref_count, charged_tier = self.ref_count, self.charged_tier
        for block_id in block_ids:
            ref_count[block_id] = 1
            charged_tier[block_id] = tier
        self.used_by_tier[tier] += num_blocks
        return block_ids

    def release(self, block_id: int) -> None:
        """Drop one reference; at zero the block becomes cached-free (if hashed) or free."""
        self.release_all((block_id,))

    def release_all(self, block_ids: Iterable[int]) -> None:
        """`release` each block in turn: the later ones become the more recently used (a
        request's blocks come last first: `KVCacheManager.free`)."""
        ref_count, charged_tier, block_hash = self.ref_count, self.charged_tier, self.block_hash
        used, free, lru_of_tier = self.used_by_tier, self._free, self._lru_of_tier
        num_cached = 0  # added to `_num_evictable` once, at the end (or where it stops)
        try:
            for block_id in block_ids:
                count = ref_count[block_id] - 1
                if count < 0:
                    raise KVIntegrityError(f"block {block_id} released more often than taken")
                ref_count[block_id] = count
                if count:
                    continue
                tier = charged_tier[block_id]
                used[tier] -= 1
                if block_hash[block_id] is None:
                    charged_tier[block_id] = NO_TIER
                    free.append(block_id)
                else:
                    lru_of_tier[tier][block_id] = None  # most recently used at the end
                    num_cached += 1
        finally:
            self._num_evictable += num_cached

    def register_run(
        self,
        block_ids: Sequence[int],
        keys: Sequence[BlockKey],
        token_ids: Sequence[int],
        start: int,
        stop: int,
        root: BlockKey | None = None,
    ) -> None:
        """Record that blocks start..stop-1 of a request's table hold its tokens: block i holds
        `token_ids[i * block_size : (i + 1) * block_size]` after `keys[i - 1]` (block 0 after
        `root`, its salt's `salt_key`), under `keys[i]` (first writer wins: a block already
        keyed, or a key already held, stays)."""
        block_hash, content, index = self.block_hash, self._content, self._hash_to_block
        size = self.block_size
        for i in range(start, stop):
            block_id, key = block_ids[i], keys[i]
            if block_hash[block_id] is not None or key in index:
                continue
            block_hash[block_id] = key
            content[block_id] = (keys[i - 1] if i else root, tuple(token_ids[i * size : (i + 1) * size]))
            index[key] = block_id

    def next_evicted(self, num_blocks: int) -> set[int]:
        """The cached blocks that the next `num_blocks` allocations would evict (after the
        free list runs out), in `_evict`'s order; nothing changes."""
        num_evicted = num_blocks - len(self._free)
        evicted: set[int] = set()
        for lru in reversed(self._evictable):
            if num_evicted <= 0:
                break
            evicted.update(islice(lru, num_evicted))
            num_evicted -= len(lru)
        return evicted

    def _evict(self, num_blocks: int) -> list[int]:
        """Empty `num_blocks` cached-free blocks, least recently used first, P0's last (a
        prompt's allocation evicts tens of blocks: one pass for them)."""
        if num_blocks > self._num_evictable:
            raise KVIntegrityError("allocate() called with no free block")
        block_hash, content, charged_tier = self.block_hash, self._content, self.charged_tier
        index = self._hash_to_block
        evicted: list[int] = []
        left = num_blocks
        for lru in reversed(self._evictable):
            while left and lru:
                block_id, _ = lru.popitem(last=False)
                key = block_hash[block_id]
                if key is None:
                    raise KVIntegrityError(f"evictable block {block_id} has no hash")
                del index[key]
                block_hash[block_id] = None
                content[block_id] = None
                charged_tier[block_id] = NO_TIER
                evicted.append(block_id)
                left -= 1
            if not left:
                break
        self._num_evictable -= num_blocks
        return evicted

    def check_integrity(self) -> None:
        """Raises `KVIntegrityError` naming the first broken invariant."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise KVIntegrityError("a block is on the free list twice")
        evictable: set[int] = set()
        for index, lru in enumerate(self._evictable):
            for b in lru:
                if b in evictable:
                    raise KVIntegrityError(f"block {b} is evictable twice")
                if self._lru_index(self.charged_tier[b]) != index:
                    raise KVIntegrityError(f"evictable block {b} filed under the wrong list")
                evictable.add(b)
        if len(evictable) != self._num_evictable:
            raise KVIntegrityError("evictable count drifted")
        if free & evictable:
            raise KVIntegrityError("a block is both free and cached-free")
        used = [0] * len(ALL_TIERS)
        for b in range(self.num_blocks):
            self._check_block(b, free, evictable)
            if self.ref_count[b] > 0:
                used[self.charged_tier[b]] += 1
        if len(self._hash_to_block) != sum(h is not None for h in self.block_hash):
            raise KVIntegrityError("stale hashes")
        if used != self.used_by_tier:
            raise KVIntegrityError(f"per-tier usage drifted: {used} != {self.used_by_tier}")

    def _check_block(self, b: int, free: set[int], evictable: set[int]) -> None:
        refs, h = self.ref_count[b], self.block_hash[b]
        if refs > 0:
            if b in free or b in evictable:
                raise KVIntegrityError(f"block {b} is in use and free")
            if self.charged_tier[b] == NO_TIER:
                raise KVIntegrityError(f"block {b} is in use but charged to no tier")
        elif refs < 0:
            raise KVIntegrityError(f"block {b} has a negative reference count")
        elif (b in free) == (b in evictable):
            raise KVIntegrityError(f"block {b} is lost")
        elif (b in free) != (h is None):
            raise KVIntegrityError(f"block {b}: free blocks have no hash, cached-free ones have one")
        if (h is None) != (self._content[b] is None):
            raise KVIntegrityError(f"block {b}: its hash and its recorded content disagree")
        if h is not None and self._hash_to_block.get(h) != b:
            raise KVIntegrityError(f"block {b}'s hash is not indexed")
