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
