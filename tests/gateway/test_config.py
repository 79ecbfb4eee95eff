"""The gateway's config: the server's sections plus [gateway] and [[upstreams]]."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tierserve.config import ConfigError
from tierserve.gateway.config import fail_open_by_tier, load_gateway_config, parse_gateway_config
from tierserve.tiers import Tier

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UP = {"kind": "vllm", "url": "http://127.0.0.1:8000"}


def test_the_example_config_loads_with_every_kind_and_per_tier_rules() -> None:
    c = load_gateway_config(DEPLOY / "gateway.example.toml")
    assert {u.kind for u in c.upstreams} == {"vllm", "sglang", "tierserve", "openai"}
    assert c.gateway.instances == 2
    assert fail_open_by_tier(c) == {Tier.P0: True, Tier.P1: True, Tier.P2: False, Tier.P3: False}
    assert c.serve.tenants["data-pipeline"].max_tier == Tier.P2


def test_an_upstream_orders_by_priority_by_kind_unless_its_config_says_fifo() -> None:
    kinds = [
        {"name": k, "kind": k, "url": f"http://{k}:8000"} for k in ("vllm", "sglang", "tierserve", "openai")
    ]
    plain = {"name": "plain-sglang", "kind": "sglang", "url": "http://plain:8000", "order": "fifo"}
    c = parse_gateway_config({"upstreams": [*kinds, plain]})
    assert [u.orders_by_priority for u in c.upstreams] == [True, True, True, False, False]


def test_unset_tiers_follow_the_servers_fail_mode() -> None:
    c = parse_gateway_config({
        "server": {"ratelimit": {"fail_mode": "closed"}},
        "gateway": {"redis_fail": {"P0": "open"}},
        "upstreams": [UP],
    })  # fmt: skip
    assert fail_open_by_tier(c) == {Tier.P0: True, Tier.P1: False, Tier.P2: False, Tier.P3: False}


def test_the_start_up_warning_on_redis_says_each_tiers_rule_and_the_share() -> None:
    """It gave the server's line ("each replica enforces the limits on its own") for a
    gateway whose P2 and P3 are refused and whose open tiers keep 1/2 of each limit."""
    from tierserve.gateway.config import redis_fail_summary
    from tierserve.server.permissive import permissive_settings

    c = parse_gateway_config({
        "server": {"ratelimit": {"backend": "redis", "fail_mode": "open"}},
        "gateway": {"instances": 2, "redis_fail": {"P2": "closed", "P3": "closed"}},
        "upstreams": [UP],
    })  # fmt: skip
    lines = permissive_settings(c.serve, redis_fail_summary(c))
    redis = [line for line in lines if "Redis" in line]
    assert len(redis) == 1 and "replica" not in redis[0]
    assert "limits P0, P1 requests on its own, on 1/2 of each limit" in redis[0]
    assert "P2, P3 requests are refused (503)" in redis[0]
    closed = parse_gateway_config({
        "server": {"ratelimit": {"backend": "redis", "fail_mode": "closed"}}, "upstreams": [UP],
    })  # fmt: skip
    assert redis_fail_summary(closed) == ""
    assert not [line for line in permissive_settings(closed.serve, "") if "Redis" in line]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"upstreams": []}, "upstreams"),
        ({"upstreams": [{**UP, "kind": "tgi"}]}, "upstreams[0].kind"),
        ({"upstreams": [{**UP, "url": "localhost:8000"}]}, "upstreams[0].url"),
        ({"upstreams": [{**UP, "url": "http://127.0.0.1:notaport"}]}, "upstreams[0].url"),
        ({"upstreams": [{**UP, "url": "http://127.0.0.1:99999"}]}, "upstreams[0].url"),
        ({"upstreams": [{**UP, "url": "http://127.0.0.1:8000/?x=1"}]}, "upstreams[0].url"),
        ({"upstreams": [{**UP, "order": "lifo"}]}, "upstreams[0].order"),
        ({"upstreams": [{**UP, "name": "a"}, {**UP, "name": "a", "url": "http://h:1"}]}, "upstreams[1].name"),
        # One replica listed twice (under two names, or spelt two ways) took two shares of
        # the traffic; credentials in a URL became its default name, a metrics label.
        ({"upstreams": [{**UP, "name": "a"}, {**UP, "name": "b"}]}, "upstreams[1].url"),
        (
            {"upstreams": [{**UP, "url": "http://H:80/"}, {**UP, "name": "b", "url": "http://h"}]},
            "upstreams[1].url",
        ),
        ({"upstreams": [{**UP, "url": "http://user:secret@h:8000"}]}, "upstreams[0].url"),
        ({"upstreams": [UP], "gateway": {"instances": 0}}, "gateway.instances"),
        ({"upstreams": [UP], "gateway": {"redis_fail": {"P9": "open"}}}, "gateway.redis_fail.P9"),
        ({"upstreams": [UP], "gateway": {"redis_fail": {"P1": "maybe"}}}, "gateway.redis_fail.P1"),
        ({"upstreams": [UP], "gateway": {"policy": "lottery"}}, "gateway.policy"),
        ({"upstreams": [UP], "gateway": {"colour": 1}}, "gateway.colour"),
        ({"upstreams": [UP], "tenants": {"a": {"max_tier": "P7"}}}, "tenants.a.max_tier"),
        # Accepted and ignored before: a misspelt limit, a KV share over 1, a staleness bound
        # shorter than the scrapes (every upstream saturated, P0 refused).
        ({"upstreams": [UP], "gateway": {"tier_limits": {"P3": {"rps": 3}}}}, "gateway.tier_limits.P3.rps"),
        ({"upstreams": [UP], "gateway": {"max_kv_usage": 1.5}}, "gateway.max_kv_usage"),
        # One tier under two names: the last won, loosening P3's limit from 1 to 100 a second.
        (
            {
                "upstreams": [UP],
                "gateway": {
                    "tier_limits": {"P3": {"requests_per_s": 1}, "background": {"requests_per_s": 100}}
                },
            },
            "gateway.tier_limits.background: tier P3 is given twice",
        ),
        (
            {"upstreams": [UP], "gateway": {"max_wait_s": {"P1": 5, "online": 9}}},
            "gateway.max_wait_s.online: tier P1 is given twice",
        ),
        ({"upstreams": [UP], "gateway": {"read_timeout_s": 0}}, "gateway.read_timeout_s"),
        (
            {"upstreams": [UP], "gateway": {"stale_after_s": 0.1, "scrape_interval_s": 5}},
            "gateway.stale_after_s",
        ),
        # Accepted before, each to a gateway that misbehaved without a word (a review):
        # never admitted (httpx kept the leading space urlparse drops) ...
        ({"upstreams": [{**UP, "url": " http://127.0.0.1:9"}]}, "upstreams[0].url: spaces"),
        # ... every log line about it split in two, a metrics label with a control character ...
        ({"upstreams": [{**UP, "name": "a\nb"}]}, "upstreams[0].name: 1..128 printable"),
        # ... 45 % of a core on scrapes, every upstream seen as saturated ...
        (
            {"upstreams": [UP], "gateway": {"scrape_interval_s": 1e-6, "stale_after_s": 1e-5}},
            "gateway.scrape_interval_s",
        ),
        # ... and a hold silently cut to its most.
        (
            {"upstreams": [UP], "gateway": {"ejection_hold_s": 100, "max_ejection_hold_s": 1}},
            "gateway.ejection_hold_s: 100 s is longer than max_ejection_hold_s",
        ),
    ],
)
def test_a_bad_value_names_its_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_gateway_config(raw)


def test_a_wait_that_ends_before_the_queue_would_serve_the_tier_is_said_at_start() -> None:
    """A P2 wait of 6 s under a P1 flood: P2's rescue comes at 15 s, P3's aging at 5 s, so
    every P2 request timed out while P3's were served (a review)."""
    from tierserve.gateway.config import waits_shorter_than_the_queues_way_out

    assert waits_shorter_than_the_queues_way_out(parse_gateway_config({"upstreams": [UP]})) == []
    short = {"upstreams": [UP], "gateway": {"max_wait_s": {"P2": 6, "P3": 3}}}
    lines = waits_shorter_than_the_queues_way_out(parse_gateway_config(short))
    assert len(lines) == 2
    assert lines[0].startswith("gateway.max_wait_s.P2 = 6 s") and "15 s: its rescue" in lines[0]
    assert lines[1].startswith("gateway.max_wait_s.P3 = 3 s") and "5 s: its aging_s" in lines[1]
    fcfs = {"upstreams": [UP], "gateway": {"policy": "fcfs", "max_wait_s": {"P2": 6}}}
    assert waits_shorter_than_the_queues_way_out(parse_gateway_config(fcfs)) == []  # no rescue there
