"""Start-up measurements behind the executor's prefill and swap estimates.

One warm-up and one timed prefill of a few tokens, and one timed round trip of a few
blocks to the host pool: a few tens of milliseconds for the demo model. The blocks used
are scratch: nothing owns them yet when the executor starts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from tierserve.executors.pytorch.attention import SeqSpan, build_metadata
from tierserve.executors.pytorch.kv_pool import KVPool
from tierserve.executors.pytorch.model import CausalLM


@dataclass(frozen=True, slots=True)
class Calibration:
    prefill_s_per_token: float
    swap_s_per_block: float  # one direction; inf when there is no host pool

    def prefill_s(self, num_tokens: int) -> float:
        return self.prefill_s_per_token * num_tokens

    def swap_s(self, num_blocks: int) -> float:
        return self.swap_s_per_block * num_blocks if num_blocks else 0.0


def _time_prefill(model: CausalLM, pool: KVPool, num_tokens: int) -> float:
    device = pool.device
    bs = pool.layout.block_size
    span = SeqSpan(0, num_tokens, list(range(-(-num_tokens // bs))))
    ids = torch.arange(num_tokens, device=device) % model.config.vocab_size
    positions = torch.arange(num_tokens, device=device)
    rows = torch.tensor([num_tokens - 1], device=device)
    start = time.perf_counter()
    with torch.inference_mode():
        meta = build_metadata([], [span], bs, device)
        model(ids, positions, meta, pool, rows).tolist()
    return time.perf_counter() - start


def calibrate(
    model: CausalLM, pool: KVPool, num_prefill_tokens: int = 64, num_swap_blocks: int = 4
) -> Calibration:
    num_prefill_tokens = min(num_prefill_tokens, pool.num_device_blocks * pool.layout.block_size)
    _time_prefill(model, pool, num_prefill_tokens)  # warm-up: first calls allocate and pick kernels
    per_token = _time_prefill(model, pool, num_prefill_tokens) / num_prefill_tokens
    n = min(num_swap_blocks, pool.num_device_blocks, pool.num_host_blocks)
    if n == 0:
        return Calibration(per_token, math.inf)
    pairs = [(i, i) for i in range(n)]
    pool.swap_out(pairs)  # warm-up
    round_trip = pool.swap_out(pairs) + pool.swap_in(pairs)
    return Calibration(per_token, round_trip / (2 * n))
