"""K/V pools: sizing, and swap copying real block contents both ways."""

from __future__ import annotations

import pytest
import torch

from tierserve.executors.pytorch.kv_pool import KVLayout, KVPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=16, dtype=torch.float32)


def pool(num_device: int = 6, num_host: int = 4) -> KVPool:
    return KVPool(LAYOUT, num_device, num_host, torch.device("cpu"))


def test_block_bytes_and_budget_sizing() -> None:
    assert LAYOUT.bytes_per_block == 2 * 2 * 16 * 2 * 4 * 4
    assert LAYOUT.blocks_for_bytes(10 * LAYOUT.bytes_per_block + 1) == 10
    p = pool()
    assert p.device_cache.shape == (2, 2, 6, 16, 2, 4)
    assert p.host_cache.shape == (2, 2, 4, 16, 2, 4)


def test_swap_out_then_in_moves_the_contents_of_every_layer() -> None:
    p = pool()
    p.device_cache.copy_(torch.randn(p.device_cache.shape))
    original = p.device_cache.clone()
    seconds = p.swap_out([(1, 3), (4, 0)])
    assert seconds >= 0
    torch.testing.assert_close(p.host_cache[:, :, 3], original[:, :, 1])
    torch.testing.assert_close(p.host_cache[:, :, 0], original[:, :, 4])
    p.device_cache[:, :, [1, 4]] = 0
    p.swap_in([(3, 5), (0, 2)])  # back to other device blocks
    torch.testing.assert_close(p.device_cache[:, :, 5], original[:, :, 1])
    torch.testing.assert_close(p.device_cache[:, :, 2], original[:, :, 4])
    assert p.swap_out([]) == 0.0


def test_layer_views_write_through_to_the_pool() -> None:
    p = pool()
    k, v = p.layer_kv(1)
    assert k.shape == (6 * 16, 2, 4)
    k[3 * 16 + 5] = 1.0
    v[0] = 2.0
    assert torch.all(p.device_cache[1, 0, 3, 5] == 1.0)
    assert torch.all(p.device_cache[1, 1, 0, 0] == 2.0)


def test_bad_mappings_are_refused() -> None:
    p = pool()
    with pytest.raises(IndexError):
        p.swap_out([(6, 0)])
    with pytest.raises(IndexError):
        p.swap_in([(4, 0)])
    with pytest.raises(ValueError):
        p.swap_out([(0, 1), (2, 1)])
    with pytest.raises(ValueError):
        KVPool(LAYOUT, 0, 1, torch.device("cpu"))
