"""The plug-in's per-tier gauges (no vLLM needed)."""

from __future__ import annotations

from tierserve.integrations.vllm.tier_metrics import TierMetrics


def _gauge(m: TierMetrics, name: str, tier: str) -> float | None:
    return m.registry.get_sample_value(name, {"priority": tier})


def test_state_gauges_follow_every_change_and_start_at_zero() -> None:
    m = TierMetrics()
    assert _gauge(m, "llm_scheduler_queue_depth", "P2") == 0.0
    m.publish_state([1, 0, 5, 0], [10, 0, 0, 3], [0, 0, 0, 2])
    m.publish_state([1, 0, 5, 0], [10, 0, 0, 3], [0, 0, 0, 2])  # unchanged: nothing to write
    assert _gauge(m, "llm_scheduler_queue_depth", "P0") == 1.0
    assert _gauge(m, "llm_scheduler_queue_depth", "P2") == 5.0
    assert _gauge(m, "tierserve_kv_blocks_used", "P3") == 3.0
    assert _gauge(m, "tierserve_kv_blocks_borrowed", "P3") == 2.0
    m.publish_state([0, 0, 4, 0], [10, 0, 0, 0], [0, 0, 0, 0])
    assert _gauge(m, "llm_scheduler_queue_depth", "P0") == 0.0, "back to zero is a change too"
    assert _gauge(m, "llm_scheduler_queue_depth", "P2") == 4.0
    assert _gauge(m, "tierserve_kv_blocks_used", "P0") == 10.0
    assert _gauge(m, "tierserve_kv_blocks_borrowed", "P3") == 0.0
