"""Prefix-cache keys: SHA-256 chained through the parent, and a hit checked against the
block's tokens, so that a key collision costs a miss rather than serving another prompt's KV."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from tests.conftest import make_request
from tierserve.memory.block_pool import BlockKey, BlockPool, hash_block, hash_blocks, salt_key
from tierserve.memory.manager import KVCacheManager
from tierserve.request import Request
from tierserve.tiers import Tier

BLOCK = 4


def _computed(mem: KVCacheManager, tokens: list[int], salt: str | None = None) -> Request:
    """Admit a request for `tokens`, mark all of it computed, enter it into the cache, free it."""
    req = make_request(tokens=tokens)
    req.cache_salt = salt
    mem.admit(req)
    req.num_computed_tokens = req.num_tokens
    mem.cache_computed_blocks(req)
    mem.free(req)
    mem.check_integrity()
    return req


def _reused(mem: KVCacheManager, tokens: list[int], salt: str | None = None) -> int:
    req = make_request(tokens=tokens)
    req.cache_salt = salt
    mem.admit(req)
    num = req.num_computed_tokens
    mem.free(req)
    mem.check_integrity()
    return num


def colliding(parent: BlockKey | None, token_ids: Sequence[int]) -> BlockKey:
    """The worst cheap hash: every block has the same key."""
    return b"collide"


def test_keys_are_sha256_chained_through_the_parent() -> None:
    first = hash_block(None, [1, 2, 3, 4])
    assert len(first) == 32
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == first
    # Python's integer hash is not randomised: hash(-1) == hash(-2). SHA-256 keys tell them apart.
    assert hash((None, (-1,))) == hash((None, (-2,)))
    assert hash_block(None, [-1]) != hash_block(None, [-2])


def test_a_forced_key_collision_reuses_no_kv_across_different_prompts() -> None:
    mem = KVCacheManager(32, BLOCK, hash_fn=colliding)
    _computed(mem, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert _reused(mem, [10, 20, 30, 40, 50, 60, 70, 80, 90]) == 0  # same key, other tokens
    assert _reused(mem, [1, 2, 3, 4, 50, 60, 70, 80, 90]) == BLOCK  # the shared first block only
    assert mem.pool.num_key_collisions >= 2
    assert _reused(mem, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == BLOCK  # one key: one block indexed, and it hits


def test_the_default_keys_reuse_identical_prefixes() -> None:
    mem = KVCacheManager(32, BLOCK)
    _computed(mem, list(range(9)))
    assert _reused(mem, list(range(9))) == 2 * BLOCK
    assert _reused(mem, [0, 1, 2, 3, 99, 5, 6, 7, 8]) == BLOCK
    assert mem.pool.num_key_collisions == 0


def test_requests_share_cached_blocks_only_with_requests_of_the_same_salt() -> None:
    mem = KVCacheManager(32, BLOCK)
    tokens = list(range(9))
    _computed(mem, tokens, salt="tenant-a")
    assert _reused(mem, tokens, salt="tenant-b") == 0
    assert _reused(mem, tokens) == 0  # unsalted: not the salted blocks either
    assert _reused(mem, tokens, salt="tenant-a") == 2 * BLOCK
    _computed(mem, tokens)
    assert _reused(mem, tokens) == 2 * BLOCK
    assert _reused(mem, tokens, salt="tenant-b") == 0
    assert mem.pool.num_key_collisions == 0


def test_a_forced_key_collision_reuses_no_kv_across_salts() -> None:
    # Every block has one key: only the recorded parent of a first block (its salt's root)
    # tells the salts apart.
    mem = KVCacheManager(32, BLOCK, hash_fn=colliding)
    _computed(mem, [1, 2, 3, 4, 5], salt="a")
    assert _reused(mem, [1, 2, 3, 4, 5], salt="b") == 0
    assert _reused(mem, [1, 2, 3, 4, 5]) == 0
    assert _reused(mem, [1, 2, 3, 4, 5], salt="a") == BLOCK


def test_no_salt_keeps_the_unsalted_keys() -> None:
    # The engine's own requests (benchmarks, simulations) key their blocks as before salts.
    assert salt_key(None) is None
    assert salt_key("a") != salt_key("b") and len(salt_key("") or b"") == 32
    mem = KVCacheManager(32, BLOCK)
    req = _computed(mem, list(range(9)))
    assert mem.pool.block_hash.count(hash_blocks(None, req.prompt_token_ids, BLOCK)[1]) == 1


def test_hash_blocks_chains_hash_block_over_full_blocks() -> None:
    tokens = [7, 1, 9, 9, 4, 0, 2, 8, 5, 5, 3]  # two full blocks of 4 and a partial one
    first = hash_block(None, tokens[:4])
    expected = [first, hash_block(first, tokens[4:8])]
    assert hash_blocks(None, tokens, BLOCK) == expected
    assert hash_blocks(first, tokens[4:8], BLOCK) == expected[1:]
    assert hash_blocks(None, tokens[:3], BLOCK) == []


def test_hash_blocks_keys_any_64_bit_id_as_hash_block_does() -> None:
    # `hash_blocks` packs the ids with struct, `hash_block` with array: the same bytes.
    tokens = [0, -1, 2**63 - 1, -(2**63), 128_000, 5, 2**31, -(2**31) - 1]
    first = hash_block(None, tokens[:4])
    assert hash_blocks(None, tokens, BLOCK) == [first, hash_block(first, tokens[4:])]
    with pytest.raises(OverflowError):  # an id past 64 bits: array's error, as before
        hash_blocks(None, [2**63, 0, 0, 0], BLOCK)


@pytest.mark.parametrize("bad", [99, None], ids=["id past the pool", "not an id"])
def test_a_release_stopped_midway_keeps_the_pool_consistent(bad: object) -> None:
    # The cached blocks released before the error stay counted as free.
    pool = BlockPool(4, 1)
    block = pool.allocate(Tier.P1)
    pool.register_run([block], [hash_block(None, [5])], [5], 0, 1)
    with pytest.raises((IndexError, TypeError)):
        pool.release_all([block, bad])  # type: ignore[list-item]
    assert pool.num_free == 4
    pool.check_integrity()
