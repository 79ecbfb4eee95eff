from __future__ import annotations

from pathlib import Path

import pytest

from tierserve.tiers import Tier
from tierserve.workloads.spec import TierMix
from tierserve.workloads.trace_stream import trace_stream
from tierserve.workloads.traces import TraceRecord, load_trace


def test_mooncake_hash_ids_produce_shared_token_prefixes() -> None:
    records = [
        TraceRecord(0.0, 1500, 10, (0, 1, 2)),
        TraceRecord(1.0, 1100, 10, (0, 1, 7)),
        TraceRecord(2.0, 300, 10, (5,)),
    ]
    a, b, c = trace_stream(records, seed=4, max_model_len=32768)
    assert a.prompt_token_ids[:1024] == b.prompt_token_ids[:1024]
    assert a.prompt_token_ids[1024:1100] != b.prompt_token_ids[1024:1100]
    assert a.prompt_token_ids[:16] != c.prompt_token_ids[:16]
    assert (a.num_prompt_tokens, b.num_prompt_tokens, c.num_prompt_tokens) == (1500, 1100, 300)


def test_rows_without_hash_ids_get_unique_prompts() -> None:
    a, b = trace_stream([TraceRecord(0.0, 64, 1), TraceRecord(0.0, 64, 1)], seed=0, max_model_len=4096)
    assert a.prompt_token_ids != b.prompt_token_ids


def test_arrivals_scale_and_lengths_fit_the_context() -> None:
    records = [TraceRecord(10.0, 9000, 0, tuple(range(18))), TraceRecord(30.0, 100, 5000)]
    a, b = trace_stream(records, seed=0, max_model_len=4096, rate_scale=2.0)
    assert (a.arrival_s, b.arrival_s) == (5.0, 15.0)
    assert (a.num_prompt_tokens, a.max_tokens) == (4095, 1)  # a trace output of 0 asks for 1 token
    assert (b.num_prompt_tokens, b.max_tokens) == (100, 2048)


def test_tiers_follow_the_mix_and_the_seed() -> None:
    records = [TraceRecord(float(i), 32, 4) for i in range(4000)]
    tiers = [
        s.tier for s in trace_stream(records, seed=9, max_model_len=4096, mix=TierMix.parse("25/25/25/25"))
    ]
    assert tiers == [
        s.tier for s in trace_stream(records, seed=9, max_model_len=4096, mix=TierMix.parse("25/25/25/25"))
    ]
    for tier in Tier:
        assert tiers.count(tier) / len(tiers) == pytest.approx(0.25, abs=0.03)


def test_mooncake_replay_repeats_prefixes(shared_data: Path) -> None:
    records = load_trace(shared_data / "mooncake_conversation_trace.jsonl")[:200]
    specs = list(trace_stream(records, seed=0, max_model_len=131072))
    first_blocks = {s.prompt_token_ids[:512] for s in specs}
    assert len(first_blocks) < len(specs) // 2  # rows share their first block (hash id 0)
