"""Attention over the paged K/V pool for a mixed batch of decodes and prefill chunks.

A step's tokens are laid out decodes first (one token each), then each prefill chunk's
tokens in order. Every token's new K/V is written to its slot before attention reads,
so a chunk attends to its own tokens as well as everything cached before it. K/V are
read whole blocks at a time through each sequence's block table. Each prefill chunk gets
its own attention call; decodes share padded calls, in groups of at most `decode_group`
sequences (the executor sorts decodes by context length, so a group's padding is small).
On a CPU groups of 8 keep the gathered K/V of a call in cache: decode attention over 20-32
sequences is 10-30 % faster than in one call; on a GPU one call for all is best.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierserve.executors.pytorch.workspace import Workspace


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
class DecodeGroup:
    start: int  # first row of the group in the step's token tensor
    blocks: torch.Tensor  # [num_seqs, max_blocks] block tables, padded with block 0
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] additive: 0 at a real position


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    offset: int  # first row of the chunk in the step's token tensor
    num_tokens: int
    context_len: int  # the chunk attends to positions [0, context_len)
    blocks: torch.Tensor  # [ceil(context_len / block_size)] block ids
    mask: torch.Tensor | None  # [num_tokens, context_len] additive; None: plain causal (start == 0)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    workspace: Workspace  # the gathered K/V and other large per-layer tensors
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes
    decodes: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]


def _blocks(span: SeqSpan, block_size: int) -> list[int]:
    """The blocks holding positions [0, context_len) of one sequence."""
    n = -(-span.context_len // block_size)
    if len(span.block_ids) < n:
        raise ValueError(f"{span.context_len} tokens need {n} blocks, block table has {len(span.block_ids)}")
    return list(span.block_ids[:n])


def _additive(allowed: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """0 where `allowed`, -inf elsewhere: made once per step, not converted in every layer."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)


def _decode_group(
    start: int,
    tables: list[list[int]],
    context: list[int],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> DecodeGroup:
    width = max(map(len, tables))
    blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    allowed = torch.arange(width * block_size)[None, :] < torch.tensor(context)[:, None]
    return DecodeGroup(start, blocks.to(device), _additive(allowed[:, None, None, :], dtype, device))


def build_metadata(
    decodes: Sequence[SeqSpan],
    prefills: Sequence[SeqSpan],
    block_size: int,
    device: torch.device,
    workspace: Workspace | None = None,
    decode_group: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Index tensors and masks (in the model's `dtype`) shared by every layer of one step;
    decodes in groups of at most `decode_group` consecutive sequences (None: one group)."""
    tables = [_blocks(d, block_size) for d in decodes]
    context = [d.context_len for d in decodes]
    slots = [
        t[d.start // block_size] * block_size + d.start % block_size
        for d, t in zip(decodes, tables, strict=True)
    ]
    size = decode_group or max(len(decodes), 1)
    groups = tuple(
        _decode_group(i, tables[i : i + size], context[i : i + size], block_size, device, dtype)
        for i in range(0, len(decodes), size)
    )
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
            mask = _additive(torch.arange(p.context_len)[None, :] <= q_pos, dtype, device)
        blocks = torch.tensor(table, dtype=torch.long, device=device)
        chunks.append(PrefillChunk(offset, p.num_tokens, p.context_len, blocks, mask))
        offset += p.num_tokens
    return AttentionMetadata(
        workspace=workspace or Workspace(),
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decodes=groups,
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
    # Grouped-query attention without copying K/V per query head: the query heads that
    # share a K/V head become that head's `group` query rows.
    group = num_heads // num_kv_heads
    for g in meta.decodes:
        b = g.blocks.shape[0]
        rows = slice(g.start, g.start + b)
        qd = q[rows].view(b, num_kv_heads, group, head_dim)
        table = g.blocks.flatten()
        kd = meta.workspace.gather("k", k_rows, table).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = meta.workspace.gather("v", v_rows, table).view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask)
        out[rows] = od.reshape(b, num_heads, head_dim)
    gqa = num_heads != num_kv_heads
    for c in meta.prefills:
        rows = slice(c.offset, c.offset + c.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        if c.mask is None:  # a chunk from position 0: its own keys and values are all it sees
            kp, vp = k[rows], v[rows]
        else:
            shape = (-1, num_kv_heads, head_dim)
            kp = meta.workspace.gather("k", k_rows, c.blocks).view(shape)[: c.context_len]
            vp = meta.workspace.gather("v", v_rows, c.blocks).view(shape)[: c.context_len]
        kp, vp = kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0)
        op = F.scaled_dot_product_attention(
            qp, kp, vp, attn_mask=c.mask, is_causal=c.mask is None, enable_gqa=gqa
        )
        out[rows] = op[0].transpose(0, 1)
    return out
