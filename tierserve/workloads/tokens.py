"""Synthetic token ids: random where prompts are unique, identical where prefixes are shared.

Ids lie in [TOKEN_ID_LOW, TOKEN_ID_HIGH), away from the special tokens of real vocabularies.
A trace block (a `hash_id`) always maps to the same ids for a given seed, with no lookup
table: the ids come from a counter-based hash of (seed, hash_id, position).

Every id is one shared int object (`_ID_OBJECTS`), not a new one per token: a prompt then
costs a pointer a token (8 bytes) instead of a pointer and an int (36), which is most of a
simulation's memory on long-prompt traces (a Mooncake prompt averages 12,000 tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TOKEN_ID_LOW = 1000
TOKEN_ID_HIGH = 30000
TRACE_BLOCK_TOKENS = 512  # Mooncake: one hash_id per 512-token prefix block

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ID_OBJECTS = np.arange(TOKEN_ID_HIGH, dtype=object)  # id -> its one int object


def _shared(ids: np.ndarray) -> tuple[int, ...]:
    """The ids as a tuple of the shared int objects (as fast as `tolist`)."""
    return tuple(_ID_OBJECTS[ids].tolist())


def random_ids(rng: np.random.Generator, num_tokens: int) -> tuple[int, ...]:
    """`num_tokens` independent ids drawn from `rng`."""
    return _shared(rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=num_tokens))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a bijection on uint64 that scatters nearby inputs."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    mixed: np.ndarray = x ^ (x >> np.uint64(31))
    return mixed


def block_ids(
    seed: int, hash_ids: Sequence[int], num_tokens: int, block_tokens: int = TRACE_BLOCK_TOKENS
) -> tuple[int, ...]:
    """The prompt of a trace row: block k holds the ids of `hash_ids[k]`, cut to `num_tokens`.

    Equal hash ids give equal blocks (for the same seed), so rows that share leading hash
    ids share a token prefix. The last block may be partial.
    """
    if num_tokens > len(hash_ids) * block_tokens:
        raise ValueError(f"{num_tokens} tokens need more than {len(hash_ids)} blocks of {block_tokens}")
    num_blocks = -(-num_tokens // block_tokens)
    with np.errstate(over="ignore"):
        keys = np.asarray(hash_ids[:num_blocks], dtype=np.uint64)[:, None]
        positions = np.arange(block_tokens, dtype=np.uint64)[None, :]
        base = _mix(keys * _GOLDEN + np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
        ids = _mix(base + positions * _GOLDEN)
    span = np.uint64(TOKEN_ID_HIGH - TOKEN_ID_LOW)
    flat = (ids % span).astype(np.int64).reshape(-1)[:num_tokens] + TOKEN_ID_LOW
    return _shared(flat)
