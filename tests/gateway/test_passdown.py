"""The tier in each engine's terms, usage read from replies, load read from metrics."""

from __future__ import annotations

import itertools
import json

import pytest

from tierserve.gateway.priority import pass_down, sglang_priority
from tierserve.gateway.saturation import MetricsParseError, parse_load
from tierserve.gateway.usage import SseUsageTap
from tierserve.tiers import ALL_TIERS, Tier

BODY = {"model": "m", "messages": [], "priority": 0, "vllm_xargs": {"x": 1}}


def test_vllm_gets_priority_lower_sooner_and_tier_and_tenant_in_xargs() -> None:
    down = pass_down("vllm", BODY, Tier.P2, "acme")
    assert down.body["priority"] == 2 and down.headers == {}
    assert down.body["vllm_xargs"] == {"x": 1, "tier": "P2", "tenant": "acme"}
    assert BODY["priority"] == 0  # the caller's body is left alone


def test_sglang_priorities_are_higher_for_urgent_tiers_and_spaced_past_the_threshold() -> None:
    values = [sglang_priority(t, 10) for t in ALL_TIERS]
    assert values == sorted(values, reverse=True)
    assert all(a - b > 10 for a, b in itertools.pairwise(values))
    assert pass_down("sglang", BODY, Tier.P0, "t", sglang_threshold=10).body["priority"] == values[0]


def test_tierserve_gets_the_header_and_openai_nothing() -> None:
    ts = pass_down("tierserve", BODY, Tier.P1, "t")
    assert ts.headers == {"x-request-tier": "P1"} and "priority" not in ts.body
    plain = pass_down("openai", BODY, Tier.P0, "t")
    assert plain.headers == {} and "priority" not in plain.body and plain.body["vllm_xargs"] == {"x": 1}


def _event(payload: object) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_the_tap_keeps_events_whole_learns_usage_and_drops_the_usage_event_when_unasked() -> None:
    text = _event({"choices": [{"delta": {"content": "hi"}}], "usage": None})
    usage = _event({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    stream = text + usage + b"data: [DONE]\n\n"
    for forward in (False, True):
        tap = SseUsageTap(forward_usage=forward)
        out = b"".join(tap.feed(stream[i : i + 5]) for i in range(0, len(stream), 5)) + tap.flush()
        assert tap.usage is not None and tap.usage.total == 10
        assert out == (stream if forward else text + b"data: [DONE]\n\n")


def test_load_is_read_from_vllm_and_sglang_names_and_a_scrape_without_them_fails() -> None:
    vllm = (
        '# HELP x\nvllm:num_requests_waiting{model_name="a"} 3.0\n'
        'vllm:num_requests_waiting{model_name="b"} 1.0\n'
        'vllm:num_requests_running{model_name="a"} 5.0\nvllm:kv_cache_usage_perc{model_name="a"} 0.5\n'
        "vllm:num_requests_waiting_by_reason 99\n"
    )
    s = parse_load("vllm", vllm, 1.0)
    assert (s.num_waiting, s.num_running, s.kv_usage, s.at) == (4.0, 5.0, 0.5, 1.0)
    sg = parse_load(
        "sglang", "sglang:num_queue_reqs 2\nsglang:num_running_reqs 8\nsglang:token_usage 0.9\n", 2.0
    )
    assert (sg.num_waiting, sg.num_running, sg.kv_usage) == (2.0, 8.0, 0.9)
    with pytest.raises(MetricsParseError):
        parse_load("tierserve", "sglang:num_queue_reqs 2\n", 0.0)


def test_the_tap_parses_only_the_events_whose_usage_is_not_null(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierserve.gateway import usage as usage_module

    parsed: list[bytes] = []
    real_loads = usage_module.json.loads

    def counting_loads(raw: bytes) -> object:
        parsed.append(raw)
        return real_loads(raw)

    monkeypatch.setattr(usage_module.json, "loads", counting_loads)
    # Every chunk of a stream that asked for usage carries `"usage": null` but the last one.
    tokens = b"".join(_event({"choices": [{"delta": {"content": t}}], "usage": None}) for t in "abc")
    tap = SseUsageTap(forward_usage=True)
    tap.feed(tokens + _event({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}))
    assert len(parsed) == 1 and tap.usage is not None and tap.usage.total == 5
