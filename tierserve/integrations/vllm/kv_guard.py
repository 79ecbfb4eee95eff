"""vLLM's `KVCacheManager`, with every allocation held to the tier partition.

`allocate_slots` is vLLM's only way into the block pool during a step. The guard asks the
ledger how many free blocks the request's tier must leave alone (more urgent tiers'
unfilled floors; whatever is past the tier's ceiling) and passes that as vLLM's own
`reserved_blocks`, so an allocation that would break a floor or a ceiling fails the way
any allocation fails when memory is short: vLLM then preempts the lowest-priority running
request (the plug-in sets `priority` to the tier) or leaves the waiting one queued.
A running request held back by its own tier's ceiling is the exception: no other tier's
blocks would make room for it, so the guard tells the scheduler (`on_ceiling`), which
points vLLM's victim choice at that tier's own latest request instead.
Everything else is vLLM's manager, unchanged.

One check of vLLM's does not read `reserved_blocks`: before it admits a waiting request it
checks that the whole prompt fits (`full_sequence_must_fit`), against the free blocks
alone. With chunked prefill a prompt that fits the pool but not the blocks its tier may
take was admitted on its first chunk, then preempted at a later one, again and again
(54 times, 12,327 prompt tokens computed for one 440-token prompt). For that call the
guard shows vLLM the pool less the reserve, so both of its checks leave the reserve alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request, RequestStatus

from tierserve.integrations.vllm.book import RequestBook
from tierserve.integrations.vllm.ledger import TierLedger
from tierserve.tiers import Tier


def holdings(manager: KVCacheManager, request_id: str) -> tuple[list[KVCacheBlock], int]:
    """The request's blocks in vLLM's pool, over all KV cache groups: those other requests
    hold too, and the number of its own. Every block's count is read: a prefix-cache hit
    shares a request's leading blocks, but vLLM caches duplicates (requests that compute the
    same tokens, as identical greedy ones do, each cache their copy), and a later hit may
    share a block that, in the list of a request holding it, comes after blocks of that
    request's own. Stopping at the first block of its own counted such a block twice: the
    tiers' counts read 57 blocks for 54 in use with 24 identical prompts and greedy output.
    (Read on the coordinator's lists: `get_block_ids` would build a list of ids for each,
    several times a step for every running request.)"""
    null = manager.block_pool.null_block  # a sliding window's dropped block: in no pool
    shared: list[KVCacheBlock] = []
    own = 0
    for blocks in manager.coordinator.get_blocks(request_id):
        # A comprehension over every block, the few shared ones sorted after: the step's
        # recount of 256 requests of 64 blocks took 0.41-0.52 ms (0.08-0.15 ms stopping at
        # the first block of its own; a plain loop 0.50-0.54, max() over attrgetter 0.95).
        others = [block for block in blocks if block.ref_cnt > 1 or block is null]
        own += len(blocks) - len(others)
        if others:
            shared += [block for block in others if block is not null]
    return shared, own


class Freeing:
    """The blocks that freeing (or preempting) some requests gives back to vLLM's pool:
    their own, and the shared ones once every holder is among them."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self._refs_left: dict[int, int] = {}
        self.num_blocks = 0

    def add(self, request_id: str) -> int:
        shared, own = holdings(self._manager, request_id)
        self.num_blocks += own
        refs_left = self._refs_left
        for block in shared:
            left = refs_left.get(block.block_id, block.ref_cnt) - 1
            refs_left[block.block_id] = left
            if left == 0:
                self.num_blocks += 1
        return self.num_blocks


class TierGuardedKVCacheManager:
    def __init__(self, inner: KVCacheManager, ledger: TierLedger, book: RequestBook) -> None:
        self.inner = inner
        self._ledger = ledger
        self._book = book
        # Called with a running request, and its tier, that its tier's ceiling holds back.
        self.on_ceiling: Callable[[Request, Tier], None] | None = None
        # Called with each request before its allocation is tried.
        self.on_allocate: Callable[[Request], None] | None = None

    def allocate_slots(
        self, request: Request, num_new_tokens: int, *args: Any, reserved_blocks: int = 0, **kwargs: Any
    ) -> KVCacheBlocks | None:
        if self.on_allocate is not None:
            self.on_allocate(request)
        tier = self._book.tier(request.request_id)
        pool = self.inner.block_pool
        num_free = pool.get_num_free_blocks()
        # vLLM's own reserve (the blocks admitted async-loading prompts still need) adds to
        # the other tiers' floors, not to what the tier's ceiling holds back.
        reserve = self._ledger.reserved_blocks(tier, num_free, also=reserved_blocks)
        if reserve and kwargs.get("full_sequence_must_fit"):
            with _free_blocks_less(pool, reserve):
                blocks = self.inner.allocate_slots(
                    request, num_new_tokens, *args, reserved_blocks=0, **kwargs
                )
        else:
            blocks = self.inner.allocate_slots(
                request, num_new_tokens, *args, reserved_blocks=reserve, **kwargs
            )
        if blocks is not None:
            # What the pool gave: new blocks and cached ones revived. A prefix hit on blocks
            # other requests hold takes none (the tier that holds them counts them). With a
            # sliding window the call also frees the blocks that slid out: the net may be less.
            taken = num_free - pool.get_num_free_blocks()
            if taken >= 0:
                self._ledger.add(tier, taken)
            else:
                self._ledger.release(tier, -taken)
        elif (
            self.on_ceiling is not None
            and request.status == RequestStatus.RUNNING
            and self._ledger.ceiling_binds(tier, num_free, also=reserved_blocks)
        ):
            self.on_ceiling(request, tier)
        return blocks

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the guard does not define: vLLM's manager answers.
        return getattr(self.inner, name)


@contextmanager
def _free_blocks_less(pool: Any, reserve: int) -> Iterator[None]:
    """The pool counts `reserve` fewer free blocks inside the block: each check vLLM makes
    against `get_num_free_blocks` leaves them alone (the step is single-threaded)."""
    count = pool.get_num_free_blocks
    pool.get_num_free_blocks = lambda: count() - reserve
    try:
        yield
    finally:
        del pool.get_num_free_blocks  # the class's method again
