"""Attention over the paged K/V pool for a mixed batch of decodes and prefill chunks.

A step's tokens are laid out decodes first (one token each), then each prefill chunk's
tokens in order. Every token's new K/V is written to its slot before attention reads,
so a chunk attends to its own tokens as well as everything cached before it. K/V are
read whole blocks at a time through each sequence's block table. Decodes share one
padded attention call; each prefill chunk gets its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class SeqSpan:
    """One sequence of the step: `num_tokens` tokens from position `start`."""

    start: int
    num_tokens: int
    block_ids: Sequence[int]

    @property
    def context_len(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    offset: int  # first row of the chunk in the step's token tensor
    num_tokens: int
    context_len: int  # the chunk attends to positions [0, context_len)
    blocks: torch.Tensor  # [ceil(context_len / block_size)] block ids
    mask: torch.Tensor | None  # [num_tokens, context_len] allowed; None: plain causal (start == 0)


class GatherBuffers:
    """Reusable output memory for gathering blocks of K and V.

    A gather's output is megabytes; allocating it afresh in every layer of every step
    costs more than the copy itself (the pages fault in each time). Each layer's
    attention finishes with the buffers before the next layer gathers into them.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def gather(self, name: str, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`rows.index_select(0, index)`, written into the buffer called `name`."""
        n = index.numel()
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1:] != rows.shape[1:] or buf.dtype != rows.dtype:
            size = max(n, 2 * buf.shape[0] if buf is not None else n)
            buf = torch.empty((size, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
            self._buffers[name] = buf
        out = buf[:n]
        torch.index_select(rows, 0, index, out=out)
        return out


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    buffers: GatherBuffers
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    num_decodes: int
    decode_blocks: torch.Tensor | None  # [num_decodes, max_blocks] block tables, padded with block 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] True: a real position
    prefills: tuple[PrefillChunk, ...]


def _blocks(span: SeqSpan, block_size: int) -> list[int]:
    """The blocks holding positions [0, context_len) of one sequence."""
    n = -(-span.context_len // block_size)
    if len(span.block_ids) < n:
        raise ValueError(f"{span.context_len} tokens need {n} blocks, block table has {len(span.block_ids)}")
    return list(span.block_ids[:n])


def build_metadata(
    decodes: Sequence[SeqSpan],
    prefills: Sequence[SeqSpan],
    block_size: int,
    device: torch.device,
    buffers: GatherBuffers | None = None,
) -> AttentionMetadata:
    """Index tensors shared by every layer of one step."""
    slots: list[int] = []
    decode_blocks = decode_mask = None
    if decodes:
        tables = [_blocks(d, block_size) for d in decodes]
        width = max(map(len, tables))
        decode_blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        context = torch.tensor([d.context_len for d in decodes])
        decode_mask = (torch.arange(width * block_size)[None, :] < context[:, None])[:, None, None, :]
        for d, table in zip(decodes, tables, strict=True):
            slots.append(table[d.start // block_size] * block_size + d.start % block_size)
    chunks: list[PrefillChunk] = []
    offset = len(decodes)
    for p in prefills:
        table = _blocks(p, block_size)
        slots.extend(
            table[pos // block_size] * block_size + pos % block_size for pos in range(p.start, p.context_len)
        )
        mask = None
        if p.start > 0:
            q_pos = torch.arange(p.start, p.context_len)[:, None]
            mask = (torch.arange(p.context_len)[None, :] <= q_pos).to(device)
        blocks = torch.tensor(table, dtype=torch.long, device=device)
        chunks.append(PrefillChunk(offset, p.num_tokens, p.context_len, blocks, mask))
        offset += p.num_tokens
    return AttentionMetadata(
        buffers=buffers or GatherBuffers(),
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=len(decodes),
        decode_blocks=None if decode_blocks is None else decode_blocks.to(device),
        decode_mask=None if decode_mask is None else decode_mask.to(device),
        prefills=tuple(chunks),
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Store k, v ([tokens, kv_heads, head_dim]) in the caches, then attend; q is [tokens, heads, head_dim].

    `k_cache`/`v_cache` are one layer's flattened pools ([slots, kv_heads, head_dim]).
    Returns [tokens, heads, head_dim].
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], k.shape[2]
    # One row per block: index_select copies whole rows, far faster than fancy indexing.
    k_rows = k_cache.view(-1, meta.block_size * num_kv_heads * head_dim)
    v_rows = v_cache.view(-1, meta.block_size * num_kv_heads * head_dim)
    out = torch.empty_like(q)
    b = meta.num_decodes
    if b:
        assert meta.decode_blocks is not None
        # Grouped-query attention without copying K/V per query head: the query heads that
        # share a K/V head become that head's `group` query rows.
        group = num_heads // num_kv_heads
        qd = q[:b].view(b, num_kv_heads, group, head_dim)
        table = meta.decode_blocks.flatten()
        kd = meta.buffers.gather("k", k_rows, table).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = meta.buffers.gather("v", v_rows, table).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        out[:b] = od.reshape(b, num_heads, head_dim)
    gqa = num_heads != num_kv_heads
    for c in meta.prefills:
        rows = slice(c.offset, c.offset + c.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        kp = meta.buffers.gather("k", k_rows, c.blocks).view(-1, num_kv_heads, head_dim)[: c.context_len]
        vp = meta.buffers.gather("v", v_rows, c.blocks).view(-1, num_kv_heads, head_dim)[: c.context_len]
        kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=c.mask, is_causal=c.mask is None, enable_gqa=gqa
        )
        out[rows] = op[0].transpose(0, 1)
    return out
