from __future__ import annotations

from pathlib import Path

import pytest

from tierserve.config import DEFAULT_TIERS, ConfigError, EngineConfig, load_config, parse_config, validate
from tierserve.tiers import Tier


def test_defaults_are_valid() -> None:
    config = validate(EngineConfig())
    assert config.tiers[Tier.P0].ttft_target_s == 0.5
    assert config.tiers[Tier.P0].floor == 0.15


def test_toml_overrides_fields_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "tiers.toml"
    path.write_text(
        "[scheduler]\nmax_num_batched_tokens = 4096\n\n"
        "[tiers.P1]\nwfq_weight = 10\nreserve = 0.2\n\n[tiers.background]\naging_s = 120\n"
    )
    config = load_config(path)
    assert config.scheduler.max_num_batched_tokens == 4096
    assert config.tiers[Tier.P1].wfq_weight == 10.0
    assert config.tiers[Tier.P1].reserve == 0.2
    assert config.tiers[Tier.P3].aging_s == 120.0
    assert config.tiers[Tier.P2] == DEFAULT_TIERS[Tier.P2]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"tiers": {"P1": {"floor": 0.5, "reserve": 0.3}, "P2": {"floor": 0.3}}}, "over 100%"),
        ({"tiers": {"P0": {"floor": 0.3, "ceiling": 0.2}}}, "tiers.P0.ceiling"),
        ({"tiers": {"P2": {"wfq_weight": -1}}}, "tiers.P2.wfq_weight"),
        ({"tiers": {"P2": {"drr_weight": 0}}}, "tiers.P2.drr_weight"),
        # Accepted, then every P1-P3 request was refused, blamed on its max_tokens.
        ({"tiers": {"P0": {"floor": 1.0, "ceiling": 1.0}, "P1": {"reserve": 0.0}}}, "tiers.P1: the floors"),
        # DRR's deficit rounds never ended: cost / quantum overflowed to inf.
        ({"tiers": {"P1": {"drr_weight": 1e-320}}}, "tiers.P1.drr_weight"),
        ({"tiers": {"P1": {"wfq_weight": float("inf")}}}, "tiers.P1.wfq_weight"),
        ({"tiers": {"P1": {"colour": 3}}}, "tiers.P1.colour"),
        ({"tiers": {"P9": {}}}, "tiers.P9"),
        ({"scheduler": {"max_num_seqs": 0}}, "scheduler.max_num_seqs"),
        ({"scheduler": {"max_num_seqs": 1.5}}, "scheduler.max_num_seqs"),
        ({"scheduler": {"enable_prefix_caching": 1}}, "scheduler.enable_prefix_caching"),
        ({"schedular": {}}, "schedular"),
        ({"tiers": {"P1": {"ttft_target_s": "fast"}}}, "tiers.P1.ttft_target_s"),
    ],
)
def test_invalid_values_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(raw)


def test_missing_and_malformed_files_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[tiers\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_tier_names_parse_in_every_spelling() -> None:
    assert Tier.parse("realtime") is Tier.P0
    assert Tier.parse("P2") is Tier.P2
    assert Tier.parse(3) is Tier.P3
    assert Tier.parse("1") is Tier.P1
    with pytest.raises(ValueError, match="unknown tier"):
        Tier.parse("urgent")
    for number in (4, -1):  # the message lists the tiers, as for a name (was the enum's own)
        with pytest.raises(ValueError, match=f"unknown tier {number}; expected one of P0/realtime"):
            Tier.parse(number)


def test_policy_tables_hold_each_policys_own_settings() -> None:
    from tierserve.scheduling.sglang_priority import SglangOptions

    config = parse_config({"policy": {"sglang-priority": {"preemption_threshold": 25}}})
    assert config.options("sglang-priority", SglangOptions).preemption_threshold == 25
    assert EngineConfig().options("sglang-priority", SglangOptions) == SglangOptions()


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"policy": {"lottery": {}}}, "policy.lottery: unknown policy"),
        ({"policy": {"fcfs": {"x": 1}}}, "policy.fcfs: policy 'fcfs' has no settings"),
        (
            {"policy": {"sglang-priority": {"preemption_threshold": -1}}},
            "policy.sglang-priority.preemption_threshold",
        ),
        ({"policy": {"sglang-priority": {"spacing": 3}}}, "policy.sglang-priority.spacing: unknown key"),
        ({"policy": {"article": {"p3_aging_s": 0}}}, "policy.article.p3_aging_s"),
        ({"policy": 3}, "policy: expected a table"),
        ({"scheduler": 3}, "scheduler: expected a table"),
    ],
)
def test_bad_policy_settings_name_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_config(raw)


@pytest.mark.parametrize("key", ["p0_step_tokens", "p0_guard_s", "p0_solo_prefill", "p3_yields"])
def test_hybrid_keys_under_scheduler_say_where_they_moved(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"scheduler\.{key}: moved to .*\[policy\.hybrid\]"):
        parse_config({"scheduler": {key: 1}})


def test_hybrid_settings_live_in_its_own_table() -> None:
    from tierserve.scheduling.hybrid import HybridOptions

    config = parse_config({"policy": {"hybrid": {"step_bound_s": 0.3, "p3_yields": False}}})
    options = config.options("hybrid", HybridOptions)
    assert options.step_bound_s == 0.3 and options.p3_yields is False
    with pytest.raises(ConfigError, match=r"policy\.hybrid\.p0_step_tokens: must be >= 1"):
        parse_config({"policy": {"hybrid": {"p0_step_tokens": 0}}})


def test_floors_over_100_percent_name_each_tiers_share_defaults_included() -> None:
    """Only P0 set, yet "130 %": P1's default reserve was counted without a word."""
    with pytest.raises(ConfigError) as e:
        parse_config({"tiers": {"P0": {"floor": 1.0, "ceiling": 1.0}}})
    message = str(e.value)
    assert "130%" in message and "P0 100%" in message and "P1 30%" in message and "default" in message


def test_a_tier_turned_off_by_a_ceiling_of_zero_may_sit_under_floors_that_take_everything() -> None:
    off = {"ceiling": 0.0, "reserve": 0.0}
    config = parse_config({"tiers": {"P0": {"floor": 1.0, "ceiling": 1.0}, "P1": off, "P2": off, "P3": off}})
    assert config.tiers[Tier.P0].floor == 1.0 and config.tiers[Tier.P3].ceiling == 0.0


def test_a_ceiling_equal_to_floor_plus_reserve_is_accepted_whatever_the_float_sum() -> None:
    """0.1 + 0.2 is 0.30000000000000004: a ceiling of 0.3 read as below it and was refused."""
    config = parse_config({"tiers": {"P1": {"floor": 0.1, "reserve": 0.2, "ceiling": 0.3}}})
    assert config.tiers[Tier.P1].ceiling == 0.3
    with pytest.raises(ConfigError, match=r"ceiling: 0\.29 is below floor"):
        parse_config({"tiers": {"P1": {"floor": 0.1, "reserve": 0.2, "ceiling": 0.29}}})
