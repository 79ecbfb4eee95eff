"""Paged K/V storage: a device pool the model reads and writes, a host pool for swap.

Both pools have the layout [layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim],
so one block of one layer is a contiguous [block_size, kv_heads, head_dim] slab and a
token's slot is `block_id * block_size + offset` in the flattened block dimension.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block of tokens."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_for_bytes(self, num_bytes: int) -> int:
        return num_bytes // self.bytes_per_block

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


class KVPool:
    """The device K/V pool and its host swap pool (pinned when the device is CUDA)."""

    def __init__(self, layout: KVLayout, num_device_blocks: int, num_host_blocks: int, device: torch.device):
        if num_device_blocks < 1:
            raise ValueError(f"the device KV pool needs at least one block, got {num_device_blocks}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.layout = layout
        self.device = device
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.device_cache = torch.zeros(layout.shape(num_device_blocks), dtype=layout.dtype, device=device)
        self.host_cache = torch.zeros(
            layout.shape(num_host_blocks), dtype=layout.dtype, pin_memory=device.type == "cuda"
        )

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of one layer's K and V as [num_blocks * block_size, kv_heads, head_dim]."""
        k, v = self.device_cache[layer]
        return k.flatten(0, 1), v.flatten(0, 1)

    def swap_out(self, mapping: Sequence[tuple[int, int]]) -> float:
        """Copy (device_block, host_block) pairs to the host pool; return measured seconds."""
        return self._copy(mapping, self.device_cache, self.host_cache)

    def swap_in(self, mapping: Sequence[tuple[int, int]]) -> float:
        """Copy (host_block, device_block) pairs back to the device pool; return measured seconds."""
        return self._copy(mapping, self.host_cache, self.device_cache)

    def _copy(self, mapping: Sequence[tuple[int, int]], src: torch.Tensor, dst: torch.Tensor) -> float:
        if not mapping:
            return 0.0
        self._check(mapping, src.shape[2], dst.shape[2])
        start = time.perf_counter()
        src_ids = torch.tensor([s for s, _ in mapping], dtype=torch.long, device=src.device)
        dst_ids = torch.tensor([d for _, d in mapping], dtype=torch.long, device=dst.device)
        blocks = src.index_select(2, src_ids).to(dst.device)
        dst.index_copy_(2, dst_ids, blocks)
        self._sync()
        return time.perf_counter() - start

    @staticmethod
    def _check(mapping: Sequence[tuple[int, int]], num_src: int, num_dst: int) -> None:
        for s, d in mapping:
            if not (0 <= s < num_src and 0 <= d < num_dst):
                raise IndexError(f"block pair ({s}, {d}) outside the pools ({num_src}, {num_dst} blocks)")
        if len({d for _, d in mapping}) != len(mapping):
            raise ValueError(f"a destination block appears twice in {list(mapping)}")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
