"""Paged attention: decodes attended in groups give what one call over all of them gives."""

from __future__ import annotations

import random

import torch

from tierserve.executors.pytorch.attention import SeqSpan, build_metadata, paged_attention

BLOCK, KV_HEADS, HEADS, HEAD_DIM, BLOCKS = 4, 2, 8, 16, 64


def test_decode_groups_match_one_call_over_every_decode() -> None:
    rng = random.Random(0)
    torch.manual_seed(0)
    free = list(range(BLOCKS))
    rng.shuffle(free)
    # Seven decodes with contexts from 3 to 30 tokens (in groups of 3: 3, 3 and 1), and a
    # prefill chunk that continues a cached prompt.
    decodes = []
    for context in sorted(rng.sample(range(3, 31), 7)):
        blocks = [free.pop() for _ in range(-(-context // BLOCK))]
        decodes.append(SeqSpan(context - 1, 1, blocks))
    prefill = SeqSpan(6, 5, [free.pop() for _ in range(3)])
    n = len(decodes) + prefill.num_tokens
    q = torch.randn(n, HEADS, HEAD_DIM)
    k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
    cache = torch.randn(2, BLOCKS * BLOCK, KV_HEADS, HEAD_DIM)

    def attend(group: int | None) -> torch.Tensor:
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        meta = build_metadata(decodes, [prefill], BLOCK, torch.device("cpu"), decode_group=group)
        return paged_attention(q, k, v, k_cache, v_cache, meta)

    one_call = attend(None)
    grouped = attend(3)
    assert len(build_metadata(decodes, [], BLOCK, torch.device("cpu"), decode_group=3).decodes) == 3
    torch.testing.assert_close(grouped, one_call)
    # Every decode row attended to its own context: a reference without the pool.
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    for i, d in enumerate(decodes):
        slots = [b * BLOCK + p % BLOCK for p in range(d.context_len) for b in [d.block_ids[p // BLOCK]]]
        k_cache[slots[-1]], v_cache[slots[-1]] = k[i], v[i]
        keys = k_cache[slots].repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        values = v_cache[slots].repeat_interleave(HEADS // KV_HEADS, dim=1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[i][:, None], keys, values)
        torch.testing.assert_close(grouped[i], want[:, 0])
