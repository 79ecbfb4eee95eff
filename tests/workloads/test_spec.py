from __future__ import annotations

import numpy as np
import pytest

from tierserve.tiers import Tier
from tierserve.workloads.spec import RequestSpec, TierMix, cap_lengths


def test_default_mix_is_the_design_shares() -> None:
    assert TierMix().label() == "5/60/30/5"


def test_parse_normalises_any_scale() -> None:
    mix = TierMix.parse("1/2/1/0")
    assert mix.shares[Tier.P1] == pytest.approx(0.5)
    assert mix.shares[Tier.P3] == 0


@pytest.mark.parametrize("text", ["5/60/30", "a/b/c/d", "0/0/0/0", "-1/2/3/4", "nan/1/1/1", "inf/1/1/1"])
def test_parse_rejects_bad_mixes(text: str) -> None:
    with pytest.raises(ValueError, match="tier mix"):
        TierMix.parse(text)


def test_draws_converge_to_the_shares() -> None:
    mix = TierMix.parse("10/50/30/10")
    rng = np.random.default_rng(3)
    tiers = [mix.draw(rng) for _ in range(20000)]
    for tier, share in mix.shares.items():
        assert tiers.count(tier) / len(tiers) == pytest.approx(share, abs=0.01)


def test_cap_keeps_output_within_half_the_context_and_the_prompt_in_the_rest() -> None:
    assert cap_lengths(100, 50, 1000) == (100, 50)
    assert cap_lengths(5000, 50, 1000) == (950, 50)
    assert cap_lengths(5000, 900, 1000) == (500, 500)
    assert cap_lengths(10, 0, 1000) == (10, 1)


def test_spec_rejects_history_longer_than_prompt() -> None:
    with pytest.raises(ValueError, match="history"):
        RequestSpec(0, Tier.P0, "t", (1, 2), 4, num_history_tokens=3)
