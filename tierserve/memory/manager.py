"""The KV-cache manager: per-request block tables over one pool, tier limits, prefix
cache and host swap. Methods are check-then-commit: a method that cannot do all of its
work returns a failure value and changes nothing.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager

from tierserve.memory.block_pool import BlockKey, BlockPool, HashFn, hash_block, hash_blocks, salt_key
from tierserve.memory.errors import KVIntegrityError
from tierserve.memory.host_pool import HostPool
from tierserve.memory.partition import TierPartition
from tierserve.request import Request
from tierserve.tiers import ALL_TIERS, Tier


class Alloc(enum.Enum):
    OK = "ok"
    NO_SPACE = "no_space"  # would fit if other requests gave blocks back
    OVER_CEILING = "over_ceiling"  # the tier already holds all it may


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        partition: TierPartition | None = None,
        enable_prefix_caching: bool = True,
        hash_fn: HashFn = hash_block,
        evict_by_tier: bool = True,
    ) -> None:
        """`hash_fn`: the prefix-cache key of a block (tests inject a weak one to force
        collisions); `evict_by_tier`: as `BlockPool`'s."""
        self.pool = BlockPool(num_blocks, block_size, evict_by_tier)
        self.host = HostPool(num_host_blocks)
        self.partition = partition or TierPartition.flat(num_blocks)
        if self.partition.num_blocks != num_blocks:
            raise ValueError("partition was built for a different number of blocks")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        self._holders: dict[str, Request] = {}  # requests holding device blocks
        self._swapped: dict[str, Request] = {}  # requests holding host blocks
        self._hashes: dict[str, list[BlockKey]] = {}  # chained keys of each request's full blocks
        self._num_registered: dict[str, int] = {}  # leading blocks already in the prefix cache
        # Requests whose full blocks may not all be in the prefix cache although no chunk
        # has completed a block since their last `cache_computed_blocks` (back from swap on
        # new blocks, or computed beyond their blocks): the only ones whose call can enter
        # a block without a block boundary crossed (see `Lifecycle.apply`).
        self.caching_behind: set[str] = set()
        self._prefix_queried = [0] * len(ALL_TIERS)
        self._prefix_hit = [0] * len(ALL_TIERS)

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def used_blocks(self, tier: Tier) -> int:
        return self.pool.used_by_tier[tier]

    def used_blocks_all_tiers(self) -> int:
        return sum(self.pool.used_by_tier)

    def borrowed_blocks(self, tier: Tier) -> int:
        return self.partition.borrowed(self.pool.used_by_tier)[tier]

    def borrowed_by_tier(self) -> list[int]:
        """`borrowed_blocks` of every tier, worked out once."""
        return self.partition.borrowed(self.pool.used_by_tier)

    def prefix_hit_rate(self, tier: Tier) -> float:
        queried = self._prefix_queried[tier]
        return self._prefix_hit[tier] / queried if queried else 0.0

    def check(self, tier: Tier, num_new_blocks: int) -> Alloc:
        """Could `tier` take `num_new_blocks` more blocks right now?"""
        used = self.pool.used_by_tier
        if used[tier] + num_new_blocks > self.partition.ceiling[tier]:
            return Alloc.OVER_CEILING
        if self.pool.num_free - num_new_blocks < self.partition.protected_free(tier, used):
            return Alloc.NO_SPACE
        return Alloc.OK

    def fits_one_each(self, tiers: Sequence[Tier]) -> bool:
        """Whether one new block for each of `tiers`, taken in this order, would each pass
        `check` (so that a run of `grow` calls can be known to succeed before the first)."""
        return self.fits_each([(tier, 1) for tier in tiers])

    def fits_each(self, needs: Sequence[tuple[Tier, int]]) -> bool:
        """Whether `grow`s taking n new blocks for tier t, for each (t, n) of `needs` in this
        order, would each pass `check` (n <= 0 takes none)."""
        used = list(self.pool.used_by_tier)
        num_free = self.pool.num_free
        for tier, n in needs:
            if n <= 0:
                continue
            if used[tier] + n > self.partition.ceiling[tier]:
                return False
            if num_free - n < self.partition.protected_free(tier, used):
                return False
            used[tier] += n
            num_free -= n
        return True

    def check_after(self, tier: Tier, num_new_blocks: int, taken: Sequence[int]) -> Alloc:
        """`check` as it would answer once `taken[t]` more blocks had gone to each tier t
        (a step's decodes, before they take them)."""
        used = [u + n for u, n in zip(self.pool.used_by_tier, taken, strict=True)]
        if used[tier] + num_new_blocks > self.partition.ceiling[tier]:
            return Alloc.OVER_CEILING
        if self.pool.num_free - sum(taken) - num_new_blocks < self.partition.protected_free(tier, used):
            return Alloc.NO_SPACE
        return Alloc.OK

    def admit_status_after(self, req: Request, taken: Sequence[int]) -> Alloc:
        """What `admit(req)` would return once `taken[t]` more blocks had gone to each tier
        t (whose allocation may evict cached blocks `req` would otherwise hit). Changes
        nothing `admit` would not change on failure."""
        num_taken = sum(taken)
        evicted = self.pool.next_evicted(num_taken) if num_taken > self.pool.num_free_uncached else set()
        hits = self._match_prefix(req, evicted)
        num_revived = sum(1 for b in hits if self.pool.ref_count[b] == 0)
        num_new = self.blocks_for(req.num_tokens) - len(hits)
        return self.check_after(req.tier, num_new + num_revived, taken)

    def cached_prefix_tokens(self, req: Request) -> int:
        """The leading tokens of waiting `req` its admission would find cached."""
        return len(self._match_prefix(req)) * self.block_size

    def blocks_to_admit(
        self, req: Request, released: Mapping[int, int], taken: Sequence[int] | None = None
    ) -> int:
        """The blocks `admit(req)` would charge once `released[b]` references to each block b
        were dropped (and, with `taken`, once `taken[t]` more blocks had gone to each tier t,
        evicting what they would): its length in blocks less the prefix hits someone else
        still holds (a hit on a block nobody holds is revived, and charged as a new one)."""
        num_taken = sum(taken) if taken is not None else 0
        evicted = self.pool.next_evicted(num_taken) if num_taken > self.pool.num_free_uncached else set()
        hits = self._match_prefix(req, evicted)
        kept = sum(1 for b in hits if self.pool.ref_count[b] > released.get(b, 0))
        return self.blocks_for(req.num_tokens) - kept

    def within_entitlement(self, tier: Tier, num_new_blocks: int) -> bool:
        """Whether the tier would still be inside its floor + reserve (so it may reclaim)."""
        return self.pool.used_by_tier[tier] + num_new_blocks <= self.partition.entitlement(tier)

    def is_borrowing(self, tier: Tier) -> bool:
        return self.borrowed_blocks(tier) > 0

    @contextmanager
    def as_if_back(self, req: Request) -> Iterator[None]:
        """Inside, the tiers' use (`used_blocks`, `borrowed_blocks`, `is_borrowing`,
        `within_entitlement`) counts swapped-out `req`'s blocks as its tier's again, as if it
        had come back: what a victim rule reads when it asks whether `req`, running, could be
        taken. Free blocks are not counted again, so nothing may be allocated inside."""
        used, n = self.pool.used_by_tier, len(req.host_block_ids)
        used[req.tier] += n
        try:
            yield
        finally:
            used[req.tier] -= n

    @contextmanager
    def as_if_taken(self, taken: Sequence[int]) -> Iterator[None]:
        """Inside, each tier t's use counts `taken[t]` blocks more, as if the requests a pass
        admits before the one asked about held them: what the victim rules read for it
        (with `as_if_back`, the same caveat: nothing may be allocated inside)."""
        used = self.pool.used_by_tier
        for tier, n in enumerate(taken):
            used[tier] += n
        try:
            yield
        finally:
            for tier, n in enumerate(taken):
                used[tier] -= n

    # ---- device blocks -------------------------------------------------------------------

    def admit(self, req: Request) -> Alloc:
        """Give a waiting request blocks for every known token, reusing cached prefix blocks."""
        if req.block_ids:
            raise KVIntegrityError(f"{req.request_id} already holds blocks")
        hits = self._match_prefix(req)
        num_revived = sum(1 for b in hits if self.pool.ref_count[b] == 0)
        num_new = self.blocks_for(req.num_tokens) - len(hits)
        status = self.check(req.tier, num_new + num_revived)
        if status is not Alloc.OK:
            return status
        for b in hits:
            self.pool.take(b, req.tier)
        req.block_ids = hits + self.pool.allocate_many(req.tier, num_new)
        req.num_computed_tokens = len(hits) * self.block_size
        self._num_registered[req.request_id] = len(hits)
        self._holders[req.request_id] = req
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
            self._prefix_queried[req.tier] += req.num_prompt_tokens
            self._prefix_hit[req.tier] += req.num_computed_tokens
        return Alloc.OK

    def grow(self, req: Request, num_tokens: int) -> Alloc:
        """Make sure the request's blocks cover its first `num_tokens` tokens."""
        num_new = -(-num_tokens // self.block_size) - len(req.block_ids)  # blocks_for, inlined
        if num_new <= 0:
            return Alloc.OK
        status = self.check(req.tier, num_new)
        if status is Alloc.OK:
            tier = req.tier
            req.block_ids.extend(self.pool.allocate_many(tier, num_new))
        return status

    def free(self, req: Request) -> None:
        """Release every device and host block of the request and forget it. Its blocks go
        back last first, as vLLM frees them: the later ones are evicted first, and a prefix
        hit, which starts at the first block, keeps as much of the prompt as it can (freed
        first block first, one eviction took a recomputed request's whole prefix)."""
        self.pool.release_all(reversed(req.block_ids))
        req.block_ids = []
        self._holders.pop(req.request_id, None)
        if req.host_block_ids:
            self.host.free(req.host_block_ids)
            req.host_block_ids = []
        self._swapped.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)
        self._num_registered.pop(req.request_id, None)
        self.caching_behind.discard(req.request_id)

    def cache_computed_blocks(self, req: Request) -> None:
        """Enter the request's newly completed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        request_id, size = req.request_id, self.block_size
        num_computed_blocks = req.num_computed_tokens // size
        num_full = min(num_computed_blocks, len(req.block_ids))
        if num_full < num_computed_blocks:
            self.caching_behind.add(request_id)
        else:
            self.caching_behind.discard(request_id)
        start = self._num_registered.get(request_id, 0)
        if num_full <= start:
            return
        tokens = _tokens_upto(req, num_full * size)
        hashes = self._block_hashes(req, num_full, tokens)
        self.pool.register_run(req.block_ids, hashes, tokens, start, num_full, salt_key(req.cache_salt))
        self._num_registered[request_id] = num_full

    # ---- swap ----------------------------------------------------------------------------

    def swap_out(self, req: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to host slots; returns (device, host) pairs to copy."""
        host_ids = self.host.allocate(len(req.block_ids))
        if host_ids is None:
            return None
        mapping = list(zip(req.block_ids, host_ids, strict=True))
        self.pool.release_all(reversed(req.block_ids))  # last first, as `free`
        req.block_ids = []
        req.host_block_ids = host_ids
        del self._holders[req.request_id]
        self._swapped[req.request_id] = req
        self._num_registered[req.request_id] = 0
        self.caching_behind.discard(req.request_id)
        return mapping

    def swap_in(self, req: Request) -> list[tuple[int, int]] | Alloc:
        """Bring a swapped request back; returns (host, device) pairs to copy, or why not."""
        status = self.check(req.tier, len(req.host_block_ids))
        if status is not Alloc.OK:
            return status
        device_ids = self.pool.allocate_many(req.tier, len(req.host_block_ids))
        mapping = list(zip(req.host_block_ids, device_ids, strict=True))
        self.host.free_after_copies(req.host_block_ids)  # the engine copies after the pass
        req.host_block_ids = []
        req.block_ids = device_ids
        del self._swapped[req.request_id]
        self._holders[req.request_id] = req
        self.caching_behind.add(req.request_id)  # its blocks are new: none is in the cache
        return mapping

    # ---- prefix cache --------------------------------------------------------------------

    def _block_hashes(self, req: Request, num_blocks: int, tokens: Sequence[int]) -> list[BlockKey]:
        """The keys of the request's first `num_blocks` blocks (`tokens`: its ids, as
        `_tokens_upto` gives them), worked out once each."""
        hashes = self._hashes.setdefault(req.request_id, [])
        if len(hashes) >= num_blocks:
            return hashes
        size = self.block_size
        parent = hashes[-1] if hashes else salt_key(req.cache_salt)
        if self._hash_fn is hash_block:  # the same keys, from one conversion of the ids
            hashes.extend(hash_blocks(parent, tokens[len(hashes) * size : num_blocks * size], size))
            return hashes
        for i in range(len(hashes), num_blocks):
            parent = self._hash_fn(parent, tokens[i * size : (i + 1) * size])
            hashes.append(parent)
        return hashes

    def _match_prefix(self, req: Request, evicted: AbstractSet[int] = frozenset()) -> list[int]:
        """The cached blocks that hold the request's leading full blocks (none of `evicted`)."""
        if not self.enable_prefix_caching:
            return []
        # Leave at least one token to compute: its logits give the next token.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[int] = []
        tokens, size = _tokens_upto(req, max_blocks * self.block_size), self.block_size
        parent = salt_key(req.cache_salt)
        lookup = self.pool.lookup
        for i, key in enumerate(self._block_hashes(req, max_blocks, tokens)):
            block = lookup(key, parent, tokens[i * size : (i + 1) * size], evicted)
            if block is None:
                break
            hits.append(block)
            parent = key
        return hits

    # ---- integrity -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Every block is free, cached or owned, exactly once; raises KVIntegrityError if not."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for rid, req in self._holders.items():
            if req.request_id != rid or req.host_block_ids:
                raise KVIntegrityError(f"{rid} is half swapped")
            refs.update(req.block_ids)
        for b in range(self.pool.num_blocks):
            if refs[b] != self.pool.ref_count[b]:
                raise KVIntegrityError(f"block {b}: {refs[b]} holders but ref_count {self.pool.ref_count[b]}")
        held: list[int] = []
        for rid, req in self._swapped.items():
            if req.block_ids:
                raise KVIntegrityError(f"swapped request {rid} still holds device blocks")
            held.extend(req.host_block_ids)
        self.host.check_integrity(held)
        used = self.pool.used_by_tier
        for t in ALL_TIERS:
            if used[t] > self.partition.ceiling[t]:
                raise KVIntegrityError(f"{t.name} is above its ceiling")


def _tokens_upto(req: Request, num_tokens: int) -> Sequence[int]:
    """The request's token ids, as its prompt where the first `num_tokens` lie within it: a
    prompt is usually a tuple, whose slices the prefix cache keeps without another copy."""
    return req.prompt_token_ids if num_tokens <= req.num_prompt_tokens else req.token_ids
