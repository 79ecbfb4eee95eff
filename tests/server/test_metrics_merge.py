"""`/metrics` merges the engine process's families into the server's: counters never go down."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tierserve.server.metrics import ServerMetrics
from tierserve.tiers import Tier


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if not s.name.endswith("_created")
    }


def _engine_side() -> ServerMetrics:
    engine = ServerMetrics("m", {Tier.P0: 0.5})
    engine.observe_first_token(Tier.P0, 0.2, num_prompt_tokens=100)
    engine.generation_tokens.inc(7)
    engine.observe_finished(Tier.P0, Tier.P0, 0.2, 1.0, "length")
    return engine


def test_engine_counters_add_to_the_servers_own() -> None:
    server = ServerMetrics("m", {Tier.P0: 0.5})
    server.reject("queue_full", Tier.P1)
    got = _samples(server.render(list(_engine_side().registry.collect())))
    assert got[("vllm:prompt_tokens_total", (("model_name", "m"),))] == 100
    assert got[("vllm:generation_tokens_total", (("model_name", "m"),))] == 7
    assert got[("tierserve_requests_total", (("finish_reason", "length"), ("priority", "P0")))] == 1
    assert got[("tierserve_rejections_total", (("priority", "P1"), ("reason", "queue_full")))] == 1
    assert got[("llm_sla_attainment", (("priority", "P0"), ("tier", "P0")))] == 1.0


def test_a_scrape_the_engine_did_not_answer_keeps_its_last_counts() -> None:
    """An engine busy past the scrape timeout sends no families; the server's own registry
    holds zeros for the engine's counters, and a scrape of those alone would read to
    Prometheus as a counter reset (a spike in every rate() over the window)."""
    server = ServerMetrics("m", {Tier.P0: 0.5})
    before = _samples(server.render(list(_engine_side().registry.collect())))
    after = _samples(server.render(()))
    for key, value in before.items():
        assert after.get(key) == value, key


def test_without_an_engine_process_the_registry_is_rendered_as_it_is() -> None:
    embedded = _engine_side()  # the engine thread writes to the server's own registry
    got = _samples(embedded.render())
    assert got[("vllm:prompt_tokens_total", (("model_name", "m"),))] == 100


def test_a_request_that_ended_with_no_token_past_its_target_counts_as_a_miss() -> None:
    """30 P0 clients that gave up after 1 s (twice the target) moved P0's attainment up: a
    request with no first token was left out. Counted now, as met and missed counters that
    give attainment over any window and summed over replicas."""
    engine = ServerMetrics("m", {Tier.P0: 0.5})
    engine.observe_finished(Tier.P0, Tier.P0, 0.2, 1.0, "length")  # met
    engine.observe_finished(Tier.P0, Tier.P0, None, 1.0, "abort")  # gave up after the target
    engine.observe_finished(Tier.P0, Tier.P0, None, 0.1, "abort")  # gone before it: no verdict
    got = _samples(ServerMetrics("m", {Tier.P0: 0.5}).render(list(engine.registry.collect())))
    labels = (("outcome", "met"), ("priority", "P0"), ("tier", "P0"))
    assert got[("llm_sla_requests_total", labels)] == 1
    assert got[("llm_sla_requests_total", (("outcome", "missed"), *labels[1:]))] == 1
    assert got[("llm_sla_attainment", (("priority", "P0"), ("tier", "P0")))] == 0.5
