"""The plug-in's guard on vLLM's KV cache manager (needs vLLM: the guard imports its types)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from tierserve.integrations.vllm.kv_guard import _free_blocks_less


def test_the_guards_smaller_free_count_ends_with_the_call_whatever_happens_in_it() -> None:
    """Inside an admission call that checks the whole prompt, the pool shows vLLM its free
    blocks less the tiers' reserve; after it (an exception included) the pool's own count."""

    class Pool:
        def get_num_free_blocks(self) -> int:
            return 10

    pool = Pool()
    with _free_blocks_less(pool, 3):
        assert pool.get_num_free_blocks() == 7
    with pytest.raises(RuntimeError), _free_blocks_less(pool, 4):
        assert pool.get_num_free_blocks() == 6
        raise RuntimeError("vLLM failed inside allocate_slots")
    assert pool.get_num_free_blocks() == 10 and "get_num_free_blocks" not in vars(pool)


def test_vllms_own_reserve_adds_to_the_floors_not_to_the_ceiling() -> None:
    """vLLM asks an admission whose KV loads asynchronously to leave free what admitted
    prompts still need; an unfilled P0 floor must stay free too (taking the larger of the
    two left room for one of them only). A tier's ceiling bounds its own blocks alone:
    vLLM's reserve does not add to what it holds back."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from tests.integrations.vllm.test_scheduler_kv import _manager
    from tierserve.integrations.vllm.book import RequestBook
    from tierserve.integrations.vllm.kv_guard import TierGuardedKVCacheManager
    from tierserve.integrations.vllm.ledger import TierLedger
    from tierserve.memory.partition import TierPartition
    from tierserve.tiers import Tier

    manager = _manager(["full"], num_blocks=40)  # 39 free: vLLM keeps one null block
    ledger = TierLedger(TierPartition(40, (15, 0, 0, 0), (0, 0, 0, 0), (40, 40, 40, 40)))
    book = RequestBook()
    guard = TierGuardedKVCacheManager(manager, ledger, book)
    request = Request("p3", list(range(1, 161)), SamplingParams(max_tokens=8), None)  # 10 blocks
    book.add(request, Tier.P3, "t")
    free = manager.block_pool.get_num_free_blocks()
    assert free - 15 >= 10 and free - 15 - 20 < 10  # fits beside either reserve, not both
    assert guard.allocate_slots(request, request.num_tokens, reserved_blocks=20) is None
    assert manager.block_pool.get_num_free_blocks() == free
    assert guard.allocate_slots(request, request.num_tokens, reserved_blocks=5) is not None
    assert ledger.used[Tier.P3] == 10

    for num_blocks, fits in ((12, True), (13, False)):
        capped = TierLedger(TierPartition(40, (0, 0, 0, 0), (0, 0, 0, 0), (40, 40, 40, 12)))  # P3: 12 at most
        guard = TierGuardedKVCacheManager(_manager(["full"], num_blocks=40), capped, book)
        asked = Request(
            f"p3-{num_blocks}", list(range(1, 16 * num_blocks + 1)), SamplingParams(max_tokens=8), None
        )
        book.add(asked, Tier.P3, "t")
        # 39 free less vLLM's 5 leave 34: the ceiling alone decides
        assert (guard.allocate_slots(asked, asked.num_tokens, reserved_blocks=5) is not None) is fits


def test_a_shared_block_after_a_requests_own_blocks_counts_once() -> None:
    """vLLM caches duplicate blocks (identical prompts and greedy output compute the same
    block in one step), so a prefix hit may share a block that, in another request's list,
    comes after blocks of that request's own. Each block counts once: own where one request
    holds it, shared (by block id) wherever it sits; a sliding window's null block never."""
    from types import SimpleNamespace

    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from tierserve.integrations.vllm.kv_guard import Freeing, holdings

    null = KVCacheBlock(0, ref_cnt=5, is_null=True)
    a_own, b_own, both = KVCacheBlock(1, ref_cnt=1), KVCacheBlock(2, ref_cnt=1), KVCacheBlock(3, ref_cnt=2)
    tail = KVCacheBlock(4, ref_cnt=1)
    lists = {"a": ([null, a_own, both, tail],), "b": ([b_own, both],)}
    manager = SimpleNamespace(
        coordinator=SimpleNamespace(get_blocks=lists.__getitem__),
        block_pool=SimpleNamespace(null_block=null),
    )
    shared_a, own_a = holdings(manager, "a")  # type: ignore[arg-type]
    shared_b, own_b = holdings(manager, "b")  # type: ignore[arg-type]
    assert (own_a, [b.block_id for b in shared_a]) == (2, [3])
    assert (own_b, [b.block_id for b in shared_b]) == (1, [3])
    freeing = Freeing(manager)  # type: ignore[arg-type]
    assert freeing.add("a") == 2  # block 3 stays with b
    assert freeing.add("b") == 4  # the whole pool in use: 1, 2, 3, 4
