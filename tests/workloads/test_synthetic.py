from __future__ import annotations

import itertools

import pytest

from tierserve.tiers import Tier
from tierserve.workloads.lengths import DEFAULT_SHAPES
from tierserve.workloads.spec import RequestSpec, TierMix
from tierserve.workloads.synthetic import synthetic_stream


def take(n: int, seed: int = 0, max_model_len: int = 131072, mix: TierMix | None = None) -> list[RequestSpec]:
    return list(itertools.islice(synthetic_stream(seed, max_model_len, mix), n))


def test_same_seed_same_stream_and_another_seed_another() -> None:
    assert take(300, seed=5) == take(300, seed=5)
    assert take(300, seed=5) != take(300, seed=6)


def test_tier_shares_converge_to_the_mix() -> None:
    specs = take(6000)
    for tier, share in TierMix().shares.items():
        assert sum(s.tier == tier for s in specs) / len(specs) == pytest.approx(share, abs=0.015)


def test_lengths_follow_each_tier_shape() -> None:
    specs = take(3000)
    for tier in (Tier.P1, Tier.P2, Tier.P3):
        shape = DEFAULT_SHAPES[tier]
        mine = [s for s in specs if s.tier == tier]
        body = [s.num_prompt_tokens - shape.num_prefix_tokens for s in mine]
        assert shape.prompt.low <= min(body) and max(body) <= shape.prompt.high
        assert all(shape.output.low <= s.max_tokens <= shape.output.high for s in mine)
    p0 = [s for s in specs if s.tier == Tier.P0]
    assert all(1000 <= s.num_prompt_tokens <= 4096 and 50 <= s.max_tokens <= 300 for s in p0)


def test_conversation_turn_extends_the_previous_prompt_and_answer() -> None:
    p0 = [s for s in take(4000) if s.tier == Tier.P0]
    last: dict[str, RequestSpec] = {}
    num_followups = 0
    for spec in p0:
        assert spec.conversation_id is not None
        previous = last.get(spec.conversation_id)
        if previous is not None:
            num_followups += 1
            assert spec.num_history_tokens == previous.num_prompt_tokens + previous.max_tokens
            assert spec.prompt_token_ids[: previous.num_prompt_tokens] == previous.prompt_token_ids
        last[spec.conversation_id] = spec
    assert num_followups > len(p0) // 2  # conversations really grow


def test_tenants_share_their_prefix() -> None:
    p2 = [s for s in take(1000) if s.tier == Tier.P2]
    by_tenant: dict[str, set[tuple[int, ...]]] = {}
    for s in p2:
        by_tenant.setdefault(s.tenant, set()).add(s.prompt_token_ids[:256])
    assert len(by_tenant) == 2 and all(len(prefixes) == 1 for prefixes in by_tenant.values())


def test_lengths_fit_a_short_context() -> None:
    assert all(s.num_prompt_tokens + s.max_tokens <= 1024 for s in take(500, max_model_len=1024))
