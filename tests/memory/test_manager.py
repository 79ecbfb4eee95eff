from __future__ import annotations

from tests.conftest import make_request
from tierserve.config import DEFAULT_TIERS
from tierserve.memory.block_pool import BlockPool
from tierserve.memory.errors import KVIntegrityError
from tierserve.memory.manager import Alloc, KVCacheManager
from tierserve.memory.partition import TierPartition
from tierserve.request import Request
from tierserve.tiers import Tier


def tiered(num_blocks: int = 100, block: int = 4, host: int = 0) -> KVCacheManager:
    return KVCacheManager(num_blocks, block, host, TierPartition.from_tiers(num_blocks, DEFAULT_TIERS))


def test_partition_follows_the_configured_fractions() -> None:
    p = TierPartition.from_tiers(1000, DEFAULT_TIERS)
    assert p.floor[Tier.P0] == 150 and p.ceiling[Tier.P0] == 400
    assert p.reserve[Tier.P1] == 300
    assert p.num_shared == 550


def test_identical_prefixes_share_blocks_and_count_hits_per_tier() -> None:
    mem = KVCacheManager(50, 4)
    prompt = list(range(18))  # 4 full blocks + 2 tokens
    a = make_request(tokens=prompt, tier=Tier.P0)
    assert mem.admit(a) is Alloc.OK
    a.num_computed_tokens = a.num_tokens
    mem.cache_computed_blocks(a)
    b = make_request(tokens=[*prompt[:16], 99, 98, 97], tier=Tier.P0)
    assert mem.admit(b) is Alloc.OK
    assert b.block_ids[:4] == a.block_ids[:4]
    assert b.num_computed_tokens == 16 and b.num_cached_tokens == 16
    assert [mem.pool.ref_count[x] for x in a.block_ids[:4]] == [2, 2, 2, 2]
    assert mem.prefix_hit_rate(Tier.P0) == 16 / (18 + 19)
    assert mem.prefix_hit_rate(Tier.P3) == 0.0
    mem.check_integrity()


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    mem = KVCacheManager(50, 4)
    prompt = list(range(16))
    a = make_request(tokens=prompt)
    mem.admit(a)
    a.num_computed_tokens = 16
    mem.cache_computed_blocks(a)
    b = make_request(tokens=list(prompt))
    mem.admit(b)
    assert b.num_computed_tokens == 12


def _computed_then_freed(mem: KVCacheManager, *requests: Request) -> None:
    """Each request admitted, its prompt computed into the prefix cache, and freed, in turn."""
    for r in requests:
        assert mem.admit(r) is Alloc.OK
        r.num_computed_tokens = r.num_tokens
        mem.cache_computed_blocks(r)
        mem.free(r)


def test_freed_cached_blocks_stay_reusable_until_evicted_lowest_tier_first() -> None:
    mem = KVCacheManager(6, 4)
    low = make_request(tokens=list(range(8)), tier=Tier.P3)
    high = make_request(tokens=list(range(100, 108)), tier=Tier.P0)
    _computed_then_freed(mem, low, high)
    assert mem.num_free_blocks == 6 and mem.pool.num_cached_free == 4
    # Four blocks are needed: two plain free ones, then P3's cached blocks are evicted.
    filler = make_request(tokens=[7] * 16, tier=Tier.P1)
    assert mem.admit(filler) is Alloc.OK
    mem.free(filler)
    again = make_request(tokens=list(range(100, 109)), tier=Tier.P0)
    assert mem.admit(again) is Alloc.OK and again.num_cached_tokens == 8
    low_again = make_request(tokens=list(range(9)), tier=Tier.P3)
    assert mem.admit(low_again) is Alloc.OK and low_again.num_cached_tokens == 0
    mem.check_integrity()


def test_a_freed_request_loses_its_last_blocks_first_and_keeps_its_prefix() -> None:
    """As vLLM frees them: last block first. Freed first block first, one eviction took the
    first block, and with it every prefix hit on the request's prompt (a recomputed request
    computed its whole prompt again)."""
    mem = KVCacheManager(5, 4)
    a = make_request(tokens=list(range(16)), tier=Tier.P3)
    assert mem.admit(a) is Alloc.OK
    a.num_computed_tokens = 16
    mem.cache_computed_blocks(a)
    mem.free(a)
    taker = make_request(tokens=[7] * 8, tier=Tier.P3)  # one plain free block, then one eviction
    assert mem.admit(taker) is Alloc.OK
    mem.free(taker)
    again = make_request(tokens=list(range(16)), tier=Tier.P3)
    assert mem.admit(again) is Alloc.OK and again.num_cached_tokens == 12  # 3 of its 4 blocks
    mem.check_integrity()


def test_a_lower_tier_cannot_touch_an_unfilled_floor() -> None:
    mem = tiered()  # P0 floor 15 blocks
    p2 = make_request(num_prompt=4 * 85, tier=Tier.P2)
    assert mem.admit(p2) is Alloc.OK  # 85 blocks: everything but P0's floor
    assert mem.check(Tier.P2, 1) is Alloc.NO_SPACE
    assert mem.check(Tier.P1, 1) is Alloc.NO_SPACE
    assert mem.check(Tier.P0, 15) is Alloc.OK


def test_ceiling_caps_a_tier_even_with_free_memory() -> None:
    mem = tiered()
    assert mem.admit(make_request(num_prompt=4 * 40, tier=Tier.P0)) is Alloc.OK
    assert mem.check(Tier.P0, 1) is Alloc.OVER_CEILING
    assert mem.check(Tier.P1, 1) is Alloc.OK


def test_borrowing_is_attributed_to_the_least_urgent_tiers() -> None:
    mem = tiered()  # shared = 55 blocks, P1 reserve 30
    p2 = make_request(num_prompt=4 * 40, tier=Tier.P2)
    p3 = make_request(num_prompt=4 * 40, tier=Tier.P3)
    assert mem.admit(p2) is Alloc.OK and mem.admit(p3) is Alloc.OK
    assert mem.borrowed_blocks(Tier.P3) == 25 and mem.borrowed_blocks(Tier.P2) == 0
    # P1 is inside its reserve: it may reclaim, and freeing the borrower gives it room.
    assert mem.within_entitlement(Tier.P1, 30)
    assert mem.check(Tier.P1, 30) is Alloc.NO_SPACE
    mem.free(p3)
    assert mem.check(Tier.P1, 30) is Alloc.OK


def test_failed_allocations_change_nothing() -> None:
    mem = KVCacheManager(4, 4)
    big = make_request(num_prompt=40)
    assert mem.admit(big) is Alloc.OVER_CEILING  # a flat partition caps every tier at the pool
    first = make_request(num_prompt=4, tier=Tier.P2)
    assert mem.admit(first) is Alloc.OK
    second = make_request(num_prompt=16)
    assert mem.admit(second) is Alloc.NO_SPACE
    assert not second.block_ids and mem.num_free_blocks == 3
    mem.free(first)
    small = make_request(num_prompt=15)
    assert mem.admit(small) is Alloc.OK
    small.token_ids.extend([1, 2])
    assert mem.grow(small, small.num_tokens) is not Alloc.OK
    assert len(small.block_ids) == 4
    mem.check_integrity()


def test_swap_out_and_in_keep_progress_and_move_blocks() -> None:
    mem = KVCacheManager(8, 4, num_host_blocks=8)
    req = make_request(num_prompt=10)
    mem.admit(req)
    req.num_computed_tokens = 10
    out = mem.swap_out(req)
    assert out is not None and len(out) == 3 and mem.num_free_blocks == 8
    assert req.num_computed_tokens == 10 and len(req.host_block_ids) == 3
    back = mem.swap_in(req)
    assert not isinstance(back, Alloc) and len(back) == 3
    assert [h for h, _ in back] == [h for _, h in out]
    assert mem.host.num_free == 5  # the swap-in reads them when the step's copies run
    mem.check_integrity()
    mem.host.copies_done()
    assert mem.host.num_free == 8
    mem.check_integrity()


def test_a_swap_out_does_not_take_the_host_slots_a_swap_in_of_the_same_pass_reads() -> None:
    """The engine copies swap-outs first (their device blocks may be a swap-in's
    destination); a swap-out handed the slots a swap-in had just given up overwrote that
    request's KV before it was read, and it resumed on another request's KV."""
    mem = KVCacheManager(8, 4, num_host_blocks=3)
    a, b = make_request(num_prompt=12), make_request(num_prompt=12)
    assert mem.admit(a) is Alloc.OK
    read = [h for _, h in mem.swap_out(a) or []]
    assert mem.admit(b) is Alloc.OK
    assert not isinstance(mem.swap_in(a), Alloc)
    assert mem.swap_out(b) is None  # the slots a's copy-in reads are not free yet
    mem.host.copies_done()
    assert sorted(h for _, h in mem.swap_out(b) or []) == sorted(read)  # free after the copies
    mem.check_integrity()


def test_integrity_check_catches_a_double_free() -> None:
    pool = BlockPool(4, 4)
    b = pool.allocate(Tier.P1)
    pool.release(b)
    try:
        pool.release(b)
    except KVIntegrityError:
        return
    raise AssertionError("double release went unnoticed")


def test_integrity_check_catches_a_lost_block() -> None:
    mem = KVCacheManager(4, 4)
    req = make_request(num_prompt=8)
    mem.admit(req)
    req.block_ids.pop()  # the manager still counts a reference nobody holds
    try:
        mem.check_integrity()
    except KVIntegrityError:
        return
    raise AssertionError("a leaked block went unnoticed")


def _pool_with_cached_and_free_blocks() -> BlockPool:
    """12 blocks: 4 free, 8 cached-free across tiers (in an LRU order), none in use."""
    pool = BlockPool(12, 2)
    held = [(pool.allocate(tier), tier) for tier in (Tier.P3, Tier.P1, Tier.P2, Tier.P0) * 3]
    keys = [bytes([i]) * 32 for i in range(len(held))]
    for i, (block_id, _) in enumerate(held[:8]):
        pool.register_run([block_id], [keys[i]], [i, i], 0, 1)
    pool.release_all(b for b, _ in held)
    return pool


def test_allocate_many_hands_out_what_allocate_would_in_the_same_order() -> None:
    for num_blocks in (0, 3, 4, 5, 12):  # from the free list only, to it exactly, into evictions
        one_by_one, at_once = _pool_with_cached_and_free_blocks(), _pool_with_cached_and_free_blocks()
        expected = [one_by_one.allocate(Tier.P1) for _ in range(num_blocks)]
        assert at_once.allocate_many(Tier.P1, num_blocks) == expected
        for pool in (one_by_one, at_once):
            pool.check_integrity()
        assert at_once.ref_count == one_by_one.ref_count
        assert at_once.charged_tier == one_by_one.charged_tier
        assert at_once.used_by_tier == one_by_one.used_by_tier
        assert at_once.block_hash == one_by_one.block_hash
        assert at_once.num_free == one_by_one.num_free == 12 - num_blocks


def test_next_evicted_names_the_blocks_allocations_would_evict() -> None:
    for num_blocks in (0, 4, 5, 9, 12):  # the free list only, exactly, then into evictions
        pool = _pool_with_cached_and_free_blocks()
        predicted = pool.next_evicted(num_blocks)
        cached = {b for b in range(12) if pool.block_hash[b] is not None}
        taken = pool.allocate_many(Tier.P2, num_blocks)
        assert predicted == cached & set(taken)
        assert len(predicted) == max(0, num_blocks - 4)


def _state_after_taking(mem: KVCacheManager, taken: list[int]) -> None:
    """Give each tier t `taken[t]` more blocks, as a step's decodes would."""
    for tier, n in zip(Tier, taken, strict=True):
        if n:
            mem.pool.allocate_many(tier, n)


def test_the_what_if_checks_answer_as_the_real_ones_once_the_blocks_are_taken() -> None:
    """`check_after` and `admit_status_after` (the fast simulation's look at the next
    pass) agree with `check` and `admit` after the blocks have really been taken: floors,
    ceilings, free blocks and prefix hits on cached blocks that the taking evicts."""
    prompt = list(range(40))  # 10 blocks of 4
    cases = 0
    for taken in ([0, 0, 0, 0], [0, 3, 0, 0], [0, 0, 0, 9], [2, 0, 5, 0], [0, 12, 0, 0], [0, 0, 30, 0]):
        for tier in Tier:
            for hold in (0, 6, 25):
                setups = []
                for _ in range(2):
                    mem = tiered(num_blocks=60)
                    cached = make_request(tokens=list(prompt), tier=Tier.P3)
                    assert mem.admit(cached) is Alloc.OK
                    cached.num_computed_tokens = 40
                    mem.cache_computed_blocks(cached)
                    mem.free(cached)  # 10 cached-free blocks, evicted first (P3's)
                    if hold:
                        assert mem.admit(make_request(num_prompt=hold * 4, tier=Tier.P1)) is Alloc.OK
                    setups.append(mem)
                what_if, real = setups
                head = make_request(tokens=[*prompt, 7, 7], tier=tier)
                expected_check = [what_if.check_after(tier, n, taken) for n in (1, 8, 20)]
                expected_admit = what_if.admit_status_after(head, taken)
                assert not head.block_ids  # nothing taken
                assert what_if.used_blocks_all_tiers() == real.used_blocks_all_tiers()
                _state_after_taking(real, taken)
                assert expected_check == [real.check(tier, n) for n in (1, 8, 20)]
                assert expected_admit is real.admit(head)
                cases += expected_admit is not Alloc.OK
    assert cases > 0  # some heads are refused, some admitted


def test_admit_status_after_loses_a_hit_that_the_taking_evicts() -> None:
    """A shared prefix whose first block is cached-free and whose second is in use (two
    requests prefilled it side by side: the first writer of each key won): once the
    decodes' new blocks evict the first, the second is no hit either, and the head needs
    one more block than the hits as they stand would say."""
    mem = KVCacheManager(15, 4)
    prefix = list(range(8))
    a = make_request(tokens=[*prefix[:4], 100], tier=Tier.P3)
    r = make_request(tokens=[*prefix, 200], tier=Tier.P1)
    b = make_request(tokens=list(range(500, 512)), tier=Tier.P0)
    for req in (a, r, b):
        assert mem.admit(req) is Alloc.OK
    for req in (a, r, b):
        req.num_computed_tokens = req.num_tokens
        mem.cache_computed_blocks(req)
    assert r.block_ids[0] != a.block_ids[0] and mem.pool.block_hash[r.block_ids[1]] is not None
    mem.free(a)  # its first block: cached-free, the first evicted
    mem.free(b)  # three cached-free blocks, evicted after it
    head = make_request(tokens=[*prefix, 300], tier=Tier.P1)
    taken = [0, 0, 10, 0]  # P2's decodes: the 8 free blocks, then A's block and one of B's
    assert mem.check(Tier.P1, 2) is Alloc.OK  # the hits as they stand: 1 new + 1 revived
    status = mem.admit_status_after(head, taken)
    mem.pool.allocate_many(Tier.P2, 10)
    assert status is mem.admit(head) is Alloc.NO_SPACE


def test_a_pool_without_tiers_evicts_in_one_lru_order_whatever_the_tier() -> None:
    """fcfs and vllm-priority share one pool, as vLLM does, and vLLM's one free queue evicts
    least recently used first; here P3's cached blocks went first under every policy, so a
    prompt kept its prefix hits or lost them by its tier's label alone."""

    def survivors(evict_by_tier: bool, mem: KVCacheManager | None = None) -> int:
        mem = mem or KVCacheManager(4, 4, evict_by_tier=evict_by_tier)
        first = make_request(tokens=list(range(8)), tier=Tier.P0)  # freed first: least recent
        later = make_request(tokens=list(range(100, 108)), tier=Tier.P3)
        _computed_then_freed(mem, first, later)
        taker = make_request(tokens=[7] * 8, tier=Tier.P1)  # evicts two cached blocks
        assert mem.admit(taker) is Alloc.OK
        mem.free(taker)
        mem.check_integrity()
        again = make_request(tokens=list(range(9)), tier=Tier.P0)
        assert mem.admit(again) is Alloc.OK
        return again.num_cached_tokens

    assert survivors(evict_by_tier=True) == 8  # P3's went first
    assert survivors(evict_by_tier=False) == 0  # the least recently used went first: P0's
    # The engine gives the policies that share one pool the one LRU.
    from tierserve.clock import VirtualClock
    from tierserve.config import EngineConfig
    from tierserve.engine import Engine
    from tierserve.executors.null import NullExecutor

    for policy in ("fcfs", "vllm-priority", "sglang-priority"):
        engine = Engine(
            EngineConfig(), policy, NullExecutor(num_device_blocks=4, block_size=4), VirtualClock()
        )
        assert survivors(False, engine.memory) == 0, policy


def test_tiered_eviction_keeps_p0_last_and_evicts_the_others_least_recently_used_first() -> None:
    """P3's, then P2's, then P1's cached blocks went first whatever their age: a P1 prompt
    used long ago outlived a P3 prompt used a moment ago. Only P0's are kept apart."""
    mem = KVCacheManager(6, 4)  # tiered by default
    p0, p1, p3 = (
        make_request(tokens=list(range(k, k + 8)), tier=t)
        for k, t in ((0, Tier.P0), (100, Tier.P1), (200, Tier.P3))
    )
    _computed_then_freed(mem, p0, p1, p3)  # p0 least recent, then p1, then p3
    taker = make_request(tokens=[7] * 8, tier=Tier.P2)  # evicts two cached blocks
    assert mem.admit(taker) is Alloc.OK
    mem.free(taker)
    hits = {}
    for k, t in ((200, Tier.P3), (0, Tier.P0), (100, Tier.P1)):  # the hits first: none evicts
        again = make_request(tokens=list(range(k, k + 9)), tier=t)
        assert mem.admit(again) is Alloc.OK
        hits[t] = again.num_cached_tokens
        mem.free(again)
    assert hits == {Tier.P0: 8, Tier.P1: 0, Tier.P3: 8}  # P1's went: the least recent after P0's
    mem.check_integrity()
