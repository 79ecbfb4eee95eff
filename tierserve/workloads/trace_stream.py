"""Replay a trace as request specs: the trace's sizes, prefixes and (scaled) arrival times.

Traces carry no tier. Tiers are drawn i.i.d. from the tier mix with the seed, independently
of the row's shape, so each tier sees the trace's own length distribution.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from tierserve.workloads.lengths import TENANT_PREFIX
from tierserve.workloads.spec import RequestSpec, TierMix, cap_lengths
from tierserve.workloads.tokens import block_ids, random_ids
from tierserve.workloads.traces import TraceRecord

TIER_ASSIGNMENT_RULE = "tiers drawn i.i.d. from the tier mix with the seed (traces carry no tier)"


def trace_stream(
    records: Sequence[TraceRecord],
    seed: int,
    max_model_len: int,
    mix: TierMix | None = None,
    rate_scale: float = 1.0,
) -> Iterator[RequestSpec]:
    """One spec per row, in file order; `arrival_s` = the row's time / `rate_scale`.

    Rows with `hash_ids` get block-built prompts (equal ids, equal tokens); rows without
    get unique random tokens. Lengths are fitted to `max_model_len` (the prompt keeps its
    head); an output of 0 in the trace becomes 1.
    """
    if rate_scale <= 0:
        raise ValueError(f"rate scale must be > 0, got {rate_scale}")
    mix = mix or TierMix()
    tier_seed, token_seed = np.random.SeedSequence(seed).spawn(2)
    tier_rng = np.random.default_rng(tier_seed)
    token_rng = np.random.default_rng(token_seed)
    for index, record in enumerate(records):
        tier = mix.draw(tier_rng)
        num_prompt, num_output = cap_lengths(
            record.num_prompt_tokens, record.num_output_tokens, max_model_len
        )
        if record.hash_ids:
            prompt = block_ids(seed, record.hash_ids, record.num_prompt_tokens)[:num_prompt]
        else:
            prompt = random_ids(token_rng, num_prompt)
        yield RequestSpec(
            index,
            tier,
            f"{TENANT_PREFIX[tier]}-trace",
            prompt,
            num_output,
            arrival_s=record.arrival_s / rate_scale,
        )
