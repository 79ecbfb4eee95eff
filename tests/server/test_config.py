from __future__ import annotations

from pathlib import Path

import pytest

from tierserve.config import ConfigError
from tierserve.server.config import load_serve_config, parse_serve_config
from tierserve.tiers import Tier

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "example-config.toml"


def test_example_config_loads_with_tenants_limits_and_tiers() -> None:
    config = load_serve_config(EXAMPLE)
    assert config.requires_key
    api = config.tenants["api-customers"]
    assert api.max_tier is Tier.P1 and api.weight == 2.0
    assert api.limit.requests_per_s == 20 and api.limit.request_burst == 40
    assert config.limits.queue_caps[Tier.P0] == 64
    assert config.engine.tiers[Tier.P0].ttft_target_s == 0.5


def test_no_config_is_open_with_no_limits() -> None:
    config = load_serve_config(None)
    assert config.source is None and not config.requires_key and not config.tenants
    assert config.limits.global_limit.requests_per_s is None


def test_tenants_share_no_prefix_cache_unless_the_server_says_so() -> None:
    assert not parse_serve_config({}).server.share_prefix_cache_across_tenants
    shared = parse_serve_config({"server": {"share_prefix_cache_across_tenants": True}})
    assert shared.server.share_prefix_cache_across_tenants


def test_a_tenants_share_of_the_large_body_queue_is_4_at_most_the_queue() -> None:
    assert parse_serve_config({}).server.large_body_queue_per_tenant == 4
    small = parse_serve_config({"server": {"large_body_queue": 2}}).server
    assert small.large_body_queue_per_tenant == 2  # unset: no more than the whole queue
    both = parse_serve_config({"server": {"large_body_queue": 32, "large_body_queue_per_tenant": 8}})
    assert both.server.large_body_queue_per_tenant == 8


def test_burst_defaults_to_one_second_of_rate() -> None:
    tenants = {"a": {"api_keys": ["k"], "requests_per_s": 0.5}}
    config = parse_serve_config({"limits": {"tokens_per_s": 500}, "tenants": tenants})
    assert config.limits.global_limit.token_burst == 500
    assert config.tenants["a"].limit.request_burst == 1  # never below one request


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"server": {"prot": 1}}, "server.prot"),
        ({"server": {"port": 70000}}, "server.port"),
        ({"server": {"tenant_header": "yes"}}, "server.tenant_header"),
        ({"server": {"share_prefix_cache_across_tenants": 1}}, "server.share_prefix_cache_across_tenants"),
        ({"server": {"large_body_share": 0}}, "server.large_body_share"),
        ({"server": {"large_body_share": 1.5}}, "server.large_body_share"),
        ({"server": {"large_body_queue": 0}}, "server.large_body_queue"),
        ({"server": {"large_body_queue": 2.5}}, "server.large_body_queue"),
        ({"server": {"large_body_queue_per_tenant": 0}}, "server.large_body_queue_per_tenant"),
        ({"server": {"large_body_queue_per_tenant": 17}}, "server.large_body_queue_per_tenant"),
        ({"server": {"max_chat_messages": 0}}, "server.max_chat_messages"),
        ({"server": {"max_chat_messages": "many"}}, "server.max_chat_messages"),
        ({"server": {"engine_stall_s": -1}}, "server.engine_stall_s"),
        ({"server": {"engine_stall_s": float("inf")}}, "server.engine_stall_s"),
        ({"server": {"metrics_max_age_s": -0.5}}, "server.metrics_max_age_s"),
        ({"server": {"metrics_max_age_s": 61}}, "server.metrics_max_age_s"),
        ({"server": {"metrics_max_age_s": "1s"}}, "server.metrics_max_age_s"),
        ({"server": {"ratelimit": {"backend": "memcached"}}}, "server.ratelimit.backend"),
        ({"server": {"ratelimit": {"fail_mode": "maybe"}}}, "server.ratelimit.fail_mode"),
        ({"limits": {"requests_per_s": -1}}, "limits.requests_per_s"),
        ({"limits": {"request_burst": 10}}, "limits.request_burst"),
        ({"limits": {"queue_cap": {"P7": 3}}}, "limits.queue_cap.P7"),
        ({"limits": {"queue_cap": {"P1": 1.5}}}, "limits.queue_cap.P1"),
        ({"tenants": {"a": {"max_tier": "urgent"}}}, "tenants.a.max_tier"),
        ({"tenants": {"a": {"weight": 0}}}, "tenants.a.weight"),
        ({"tenants": {"a": {"api_keys": "sk-1"}}}, "tenants.a.api_keys"),
        ({"tenants": {"a": {"api_keys": ["k"]}, "b": {"api_keys": ["k"]}}}, "tenants.b.api_keys"),
        ({"tenants": {"a": {"tokens_per_s": float("inf")}}}, "tenants.a.tokens_per_s"),
        ({"tenants": {"a": {"colour": "red"}}}, "tenants.a.colour"),
        ({"tenants": {"a": 3}}, "tenants.a"),
        ({"tiers": {"P1": {"ttft_target_s": -1}}}, "tiers.P1.ttft_target_s"),
        # Accepted, then every request (/ready too) got 431.
        ({"server": {"http": {"max_header_bytes": 10}}}, "server.http.max_header_bytes"),
        # Tenants no x-tenant-id could ever name.
        ({"tenants": {"a\x00b": {"api_keys": ["k"]}}}, "tenants.'a"),
        ({"tenants": {"t" * 65: {"api_keys": ["k"]}}}, "tenants.'" + "t" * 64 + "'..."),
    ],
)
def test_invalid_values_are_rejected_naming_the_field(raw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        parse_serve_config(raw)


def test_missing_file_and_bad_toml_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_serve_config(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[server\nport = 1\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_serve_config(bad)


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        # The redis library's own error named neither the setting nor came before the start.
        ({"server": {"ratelimit": {"redis_url": "notaurl"}}}, "server.ratelimit.redis_url: expected a URL"),
        # Tier(7)'s "7 is not a valid Tier" named no valid value.
        (
            {"tenants": {"a": {"api_keys": ["k"], "max_tier": 7}}},
            "tenants.a.max_tier: expected a tier name or 0..3",
        ),
        # A default above the tenant's own ceiling was lowered to it without a word.
        (
            {"tenants": {"a": {"api_keys": ["k"], "max_tier": "P2", "default_tier": "P0"}}},
            "tenants.a.default_tier: P0 is above the tenant's max_tier P2",
        ),
        # ... and so was one above the max_tier a tenant gets when the file sets none (P3).
        (
            {"tenants": {"a": {"api_keys": ["k"], "default_tier": "realtime"}}},
            r"tenants.a.default_tier: P0 is above the tenant's max_tier P3 \(its default: set it too\)",
        ),
        # Two names for one tier were merged silently, the later winning.
        ({"tiers": {"realtime": {"floor": 0.1}, "P0": {"floor": 0.2}}}, "tier P0 is given twice"),
        ({"limits": {"queue_cap": {"realtime": 1, "P0": 5}}}, "tier P0 is given twice"),
        # The ceiling was named, though the file never set it: say that it is the default.
        ({"tiers": {"P0": {"floor": 0.6}}}, r"tiers.P0.ceiling: 0.4 is below .*defaults.* ceiling 0.4\)"),
        (  # a ceiling set to its default value, and the default reserve the culprit
            {"tiers": {"P1": {"floor": 0.9, "ceiling": 1.0}}},
            r"tiers.P1.ceiling: 1.0 is below floor \+ reserve \(0.9 \+ 0.3\).*reserve 0.3",
        ),
    ],
)
def test_errors_name_the_setting_and_what_it_takes(raw: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        parse_serve_config(raw)


def test_a_config_that_is_not_utf8_names_its_file(tmp_path: Path) -> None:
    path = tmp_path / "utf16.toml"
    path.write_bytes("[server]\nport = 1\n".encode("utf-16"))
    with pytest.raises(ConfigError, match=f"{path}: not UTF-8 text"):
        load_serve_config(path)


@pytest.mark.parametrize(
    "tenants",
    [
        {"a": {"api_keys": "sk-very-secret-key-abcdef"}},  # a string, not a list
        [{"api_keys": ["sk-very-secret-key-abcdef"]}],  # [[tenants]]: an array of tables
        {"a": "sk-very-secret-key-abcdef"},
    ],
)
def test_a_malformed_tenant_does_not_print_its_api_keys(tenants: object) -> None:
    with pytest.raises(ConfigError) as e:
        parse_serve_config({"tenants": tenants})
    assert "very-secret" not in str(e.value) and "tenants" in str(e.value)


def test_a_key_given_twice_to_one_tenant_says_so() -> None:
    with pytest.raises(ConfigError, match=r"key sk-abc\.\.\. is given twice"):
        parse_serve_config({"tenants": {"a": {"api_keys": ["sk-abcdef", "sk-abcdef"]}}})
