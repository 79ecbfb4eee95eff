from __future__ import annotations

import numpy as np
import pytest

from tierserve.workloads.tokens import TOKEN_ID_HIGH, TOKEN_ID_LOW, block_ids, random_ids


def test_equal_hash_ids_give_equal_blocks_and_different_ones_differ() -> None:
    a = block_ids(7, [0, 1, 2], 3 * 512)
    b = block_ids(7, [0, 1, 9], 3 * 512)
    assert a[:1024] == b[:1024]
    assert a[1024:] != b[1024:]


def test_block_content_depends_on_the_seed_not_the_position_in_the_row() -> None:
    assert block_ids(1, [5], 512) == block_ids(1, [4, 5], 1024)[512:]
    assert block_ids(1, [5], 512) != block_ids(2, [5], 512)


def test_last_block_may_be_partial() -> None:
    ids = block_ids(0, [3, 4], 700)
    assert len(ids) == 700
    assert ids[512:] == block_ids(0, [4], 512)[:188]


def test_too_few_blocks_is_an_error() -> None:
    with pytest.raises(ValueError):
        block_ids(0, [1], 513)


def test_ids_stay_in_range() -> None:
    ids = block_ids(11, list(range(20)), 20 * 512) + random_ids(np.random.default_rng(0), 5000)
    assert min(ids) >= TOKEN_ID_LOW and max(ids) < TOKEN_ID_HIGH
    assert len(set(ids)) > 10000  # spread, not a constant
