"""Replay a trace as request specs: the trace's sizes, prefixes and (scaled) arrival times.

Traces carry no tier. Tiers are drawn i.i.d. from the tier mix with the seed, independently
of the row's shape, so each tier sees the trace's own length distribution.

A trace is run at `rate_scale` times its rate in one of two ways (`scale_by`):

- `"time"`: every row once, its timestamp divided by the scale. The trace's requests in
  1/scale of its time: the same number of requests, its hour of traffic in minutes.
- `"copies"`: the trace's own span, `rate_scale` times as many requests, as if that many
  times the users sent it. Each row is sent `floor(rate_scale)` times, and once more with
  probability `rate_scale - floor(rate_scale)` (so a scale under 1 thins the trace). The
  first copy keeps the row's timestamp; the others arrive at uniform random moments
  before the trace's next timestamp, so the rate follows the trace's own ups and downs
  at the resolution of its gaps. A copy has its row's sizes; with `hash_ids`, each copy
  gets its own prefix tokens (a different user's conversation), shared with the same
  copy of the rows that share those ids. This is what a fleet of `rate_scale` times the
  replicas meets over the same hours, where a start-up delay or an autoscaler's calm
  period keeps its meaning (under `"time"` a 4-minute model load is most of an hour of
  trace compressed 16 times).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from tierserve.workloads.lengths import TENANT_PREFIX
from tierserve.workloads.spec import RequestSpec, TierMix, cap_lengths
from tierserve.workloads.tokens import block_ids, random_ids
from tierserve.workloads.traces import TraceRecord

TIER_ASSIGNMENT_RULE = "tiers drawn i.i.d. from the tier mix with the seed (traces carry no tier)"
SCALE_BY = ("time", "copies")


def trace_stream(
    records: Sequence[TraceRecord],
    seed: int,
    max_model_len: int,
    mix: TierMix | None = None,
    rate_scale: float = 1.0,
    scale_by: str = "time",
) -> Iterator[RequestSpec]:
    """One spec per row (per copy of a row under `scale_by="copies"`), in arrival order.

    Rows with `hash_ids` get block-built prompts (equal ids, equal tokens); rows without
    get unique random tokens. Lengths are fitted to `max_model_len` (the prompt keeps its
    head); an output of 0 in the trace becomes 1.
    """
    _check(rate_scale, scale_by)
    mix = mix or TierMix()
    tier_seed, token_seed, copy_seed = _seeds(seed)
    tier_rng = np.random.default_rng(tier_seed)
    token_rng = np.random.default_rng(token_seed)
    if scale_by == "time":
        rows: Iterator[tuple[float, TraceRecord, int]] = (
            (record.arrival_s / rate_scale, record, 0) for record in records
        )
    else:
        rows = _copies(records, rate_scale, copy_seed)
    for index, (arrival_s, record, copy) in enumerate(rows):
        tier = mix.draw(tier_rng)
        num_prompt, num_output = cap_lengths(
            record.num_prompt_tokens, record.num_output_tokens, max_model_len
        )
        if record.hash_ids:
            block_seed = seed if copy == 0 else _copy_block_seed(seed, copy)
            # The ids of the tokens kept only (a 50M-token row cut to the context made all
            # 50M first: 1.6 GB); each block's ids depend on its hash id and position alone.
            prompt = block_ids(block_seed, record.hash_ids, num_prompt)
        else:
            prompt = random_ids(token_rng, num_prompt)
        yield RequestSpec(
            index,
            tier,
            f"{TENANT_PREFIX[tier]}-trace",
            prompt,
            num_output,
            arrival_s=arrival_s,
        )


def num_cut_to_fit(records: Sequence[TraceRecord], max_model_len: int) -> int:
    """Rows whose prompt or output `trace_stream` shortens to fit the model's context (the
    reports count them: such a row's request is not the trace's)."""
    return sum(
        cap_lengths(r.num_prompt_tokens, r.num_output_tokens, max_model_len)
        != (r.num_prompt_tokens, max(1, r.num_output_tokens))
        for r in records
    )


def cut_note(num_cut: int, num_rows: int, trace: str = "the trace") -> str:
    """The line each bench prints where rows were cut to the model's context (their requests
    are not the trace's)."""
    was = "was" if num_cut == 1 else "were"
    return f"{num_cut} of {trace}'s {num_rows} rows {was} cut to the model's context"


def replay_count(
    records: Sequence[TraceRecord], seed: int, rate_scale: float = 1.0, scale_by: str = "time"
) -> int:
    """How many specs `trace_stream` gives for these arguments (without building them)."""
    _check(rate_scale, scale_by)
    if scale_by == "time":
        return len(records)
    _, _, copy_seed = _seeds(seed)
    return int(_copy_counts(len(records), rate_scale, copy_seed).sum())


def _seeds(seed: int) -> list[np.random.SeedSequence]:
    """The streams of a replay: tiers, prompt tokens, copies. The first two are what they
    were before copies existed, so "time" replays are unchanged."""
    return np.random.SeedSequence(seed).spawn(3)


def _check(rate_scale: float, scale_by: str) -> None:
    if not 0 < rate_scale < float("inf"):
        raise ValueError(f"rate scale must be > 0 and finite, got {rate_scale}")
    if scale_by not in SCALE_BY:
        raise ValueError(f"scale_by must be one of {', '.join(SCALE_BY)}, got {scale_by!r}")


def _copy_counts(num_rows: int, rate_scale: float, seed: np.random.SeedSequence) -> np.ndarray:
    """Copies of each row: floor(scale), plus one with probability frac(scale)."""
    whole = int(rate_scale)
    extra = np.random.default_rng(_child(seed, 0)).random(num_rows) < rate_scale - whole
    counts: np.ndarray = whole + extra.astype(np.int64)
    return counts


def _copies(
    records: Sequence[TraceRecord], rate_scale: float, seed: np.random.SeedSequence
) -> Iterator[tuple[float, TraceRecord, int]]:
    """(arrival, row, copy) in arrival order: each group of rows sharing a timestamp, then
    their later copies spread over the gap to the next timestamp (none after the last)."""
    counts = _copy_counts(len(records), rate_scale, seed)
    jitter = np.random.default_rng(_child(seed, 1))
    n, i = len(records), 0
    while i < n:
        t = records[i].arrival_s
        j = i
        while j < n and records[j].arrival_s == t:
            j += 1
        gap = (records[j].arrival_s - t) if j < n else 0.0
        group: list[tuple[float, int, int]] = []
        for k in range(i, j):
            c = int(counts[k])
            if c == 0:
                continue
            # The row itself arrives at its time; its other copies in the gap after it.
            group.append((t, k, 0))
            group.extend((t + float(u) * gap, k, copy) for copy, u in enumerate(jitter.random(c - 1), 1))
        group.sort()
        for arrival_s, k, copy in group:
            yield arrival_s, records[k], copy
        i = j


def _child(seed: np.random.SeedSequence, i: int) -> np.random.SeedSequence:
    """`seed`'s i-th child, the same however often it is asked for (`spawn` counts calls)."""
    return np.random.SeedSequence(seed.entropy, spawn_key=(*seed.spawn_key, i))


def _copy_block_seed(seed: int, copy: int) -> int:
    """The token seed of a copy's prefix blocks: distinct per copy, fixed by (seed, copy)."""
    state = np.random.SeedSequence([seed, copy]).generate_state(2, np.uint64)
    return int(state[0])
