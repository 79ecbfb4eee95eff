from __future__ import annotations

import pytest

from tierserve.bench.limits import engine_limits
from tierserve.config import EngineConfig


def test_default_limits_are_vllm_v1_on_an_a100_and_apply_to_the_scheduler() -> None:
    limits = engine_limits()
    assert (limits.name, limits.max_num_batched_tokens, limits.max_num_seqs) == ("vllm-a100", 2048, 256)
    config = limits.apply(EngineConfig())
    assert (config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs) == (2048, 256)


def test_the_article_setting_and_overrides() -> None:
    article = engine_limits("article")
    assert (article.max_num_batched_tokens, article.max_num_seqs) == (8192, 512)
    custom = engine_limits("article", max_num_seqs=128)
    assert (custom.name, custom.max_num_batched_tokens, custom.max_num_seqs) == (
        "article+overrides",
        8192,
        128,
    )
    assert engine_limits("article", max_num_seqs=512) == article  # the same value is no override


def test_unknown_or_empty_limits_are_refused() -> None:
    with pytest.raises(ValueError, match="vllm-a100"):
        engine_limits("h100")
    with pytest.raises(ValueError):
        engine_limits(max_num_seqs=0)


def test_a_token_budget_below_the_sequences_is_refused_as_vllm_refuses_it() -> None:
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(1\) must be >= max_num_seqs \(256\)"):
        engine_limits(max_num_batched_tokens=1)
    assert engine_limits(max_num_batched_tokens=256).max_num_batched_tokens == 256  # equal is allowed
