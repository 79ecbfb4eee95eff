from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

import pytest

from tierserve.tiers import Tier
from tierserve.workloads.spec import TierMix
from tierserve.workloads.tokens import block_ids
from tierserve.workloads.trace_stream import replay_count, trace_stream
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


# ---- rate scaling by copies ---------------------------------------------------------------


def _trace(num_rows: int, step_s: float = 1.0) -> list[TraceRecord]:
    return [TraceRecord(i * step_s, 40 + i % 7, 3 + i % 5) for i in range(num_rows)]


@pytest.mark.parametrize("scale", [0.3, 1.0, 2.5, 16.0])
def test_copies_keep_the_span_and_replay_count_matches(scale: float) -> None:
    records = _trace(300)
    specs = list(trace_stream(records, seed=5, max_model_len=4096, rate_scale=scale, scale_by="copies"))
    assert len(specs) == replay_count(records, 5, scale, "copies")
    assert len(specs) == pytest.approx(300 * scale, rel=0.15)  # binomial around scale x rows
    assert [s.index for s in specs] == list(range(len(specs)))
    arrivals = [s.arrival_s for s in specs]
    assert arrivals == sorted(arrivals)
    assert arrivals[0] >= 0.0 and arrivals[-1] <= records[-1].arrival_s  # the trace's own span


def test_whole_copies_send_each_row_that_many_times_within_its_gap() -> None:
    records = [TraceRecord(t, n, 1) for t, n in ((0.0, 10), (0.0, 20), (4.0, 30), (9.0, 40))]
    specs = list(trace_stream(records, seed=0, max_model_len=4096, rate_scale=3.0, scale_by="copies"))
    by_size: dict[int, list[float]] = {}
    for s in specs:
        by_size.setdefault(s.num_prompt_tokens, []).append(s.arrival_s)
    assert {n: len(t) for n, t in by_size.items()} == {10: 3, 20: 3, 30: 3, 40: 3}
    # Rows at 0 s keep their time once and send their copies before the next timestamp (4 s).
    for size in (10, 20):
        assert min(by_size[size]) == 0.0 and all(0.0 <= t < 4.0 for t in by_size[size])
    assert min(by_size[30]) == 4.0 and all(4.0 <= t < 9.0 for t in by_size[30])
    assert by_size[40] == [9.0, 9.0, 9.0]  # after the last timestamp there is no gap to spread over


def test_copies_with_hash_ids_are_other_users_conversations() -> None:
    records = [TraceRecord(0.0, 1024, 1, (0, 1)), TraceRecord(1.0, 1100, 1, (0, 1, 2))]
    original = list(trace_stream(records, seed=2, max_model_len=32768))
    specs = list(trace_stream(records, seed=2, max_model_len=32768, rate_scale=2.0, scale_by="copies"))
    first = [s for s in specs if s.num_prompt_tokens == 1024]
    second = [s for s in specs if s.num_prompt_tokens == 1100]
    # The first copy is the row as a time replay sends it; the second has prefix tokens of its own.
    assert first[0].prompt_token_ids == original[0].prompt_token_ids
    assert first[1].prompt_token_ids[:512] != first[0].prompt_token_ids[:512]
    # Within one copy, rows that share hash ids still share their prefix.
    assert second[0].prompt_token_ids[:1024] == first[0].prompt_token_ids
    assert second[1].prompt_token_ids[:1024] == first[1].prompt_token_ids


def test_time_scaling_is_the_default_and_unchanged_by_copies() -> None:
    records = _trace(50)
    plain = list(trace_stream(records, seed=1, max_model_len=4096, rate_scale=4.0))
    assert plain == list(trace_stream(records, seed=1, max_model_len=4096, rate_scale=4.0, scale_by="time"))
    assert [s.arrival_s for s in plain] == [r.arrival_s / 4.0 for r in records]
    assert replay_count(records, 1, 4.0) == 50


@pytest.mark.parametrize(("scale", "scale_by"), [(0.0, "copies"), (float("inf"), "copies"), (2.0, "users")])
def test_bad_scaling_is_refused(scale: float, scale_by: str) -> None:
    with pytest.raises(ValueError):
        list(trace_stream(_trace(3), seed=0, max_model_len=4096, rate_scale=scale, scale_by=scale_by))
    with pytest.raises(ValueError):
        replay_count(_trace(3), 0, scale, scale_by)


def test_num_cut_to_fit_counts_the_rows_the_replay_shortens() -> None:
    from tierserve.workloads.trace_stream import num_cut_to_fit

    rows = [
        TraceRecord(0.0, 100, 10),  # fits
        TraceRecord(0.0, 100, 0),  # an output of 0 becomes 1: not a cut
        TraceRecord(0.0, 990, 20),  # the prompt is cut to 1000 - 20
        TraceRecord(0.0, 10, 900),  # the output is cut to half the context
        TraceRecord(0.0, 980, 20),  # exactly fits
    ]
    assert num_cut_to_fit(rows, 1000) == 2
    specs = list(trace_stream(rows, 0, 1000))
    cut = [
        (len(s.prompt_token_ids), s.max_tokens) != (r.num_prompt_tokens, max(1, r.num_output_tokens))
        for s, r in zip(specs, rows, strict=True)
    ]
    assert sum(cut) == 2


def test_a_row_cut_to_the_context_makes_only_the_tokens_it_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 50M-token row cut to the context made all 50M ids first (1.6 GB); the ids kept are
    the same."""
    stream = importlib.import_module("tierserve.workloads.trace_stream")  # the package's name is the function

    asked: list[int] = []

    def counting(seed: int, hash_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        asked.append(num_tokens)
        return block_ids(seed, hash_ids, num_tokens)

    monkeypatch.setattr(stream, "block_ids", counting)
    row = TraceRecord(0.0, 512 * 40, 8, tuple(range(40)))
    (spec,) = trace_stream([row], 0, 2048)
    assert asked == [spec.num_prompt_tokens] and spec.num_prompt_tokens < 2048
    assert spec.prompt_token_ids == block_ids(0, row.hash_ids, 512 * 40)[: spec.num_prompt_tokens]
