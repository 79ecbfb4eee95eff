"""Reusable memory for a step's large intermediate tensors.

On a CPU, a fresh tensor of megabytes costs more than the arithmetic that fills it: the
allocator hands the pages back to the system when it is freed, and they fault in again,
zeroed, the next time. A prefill step makes dozens of such tensors in every layer (the
gathered K/V, the MLP's gate and up projections). A `Workspace` keeps one buffer per name
and hands out views of it; whoever takes a name is done with it before the next layer
takes it again. On a GPU it costs nothing and saves the caching allocator some work.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape`, in the buffer called `name`: valid
        until the next `take` of that name."""
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            size = max(n, 2 * buf.numel() if buf is not None and buf.dtype == dtype else n)
            buf = self._buffers[name] = torch.empty(size, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def gather(self, name: str, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`rows.index_select(0, index)`, written into the buffer called `name`."""
        out = self.take(name, (index.numel(), *rows.shape[1:]), rows.dtype, rows.device)
        torch.index_select(rows, 0, index, out=out)
        return out
