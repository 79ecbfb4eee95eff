"""The scheduler's sizing and preemption against vLLM's own KV cache manager, without an
engine (needs vLLM)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from tierserve.integrations.vllm.scheduler import TierScheduler, blocks_to_hold


def _manager(
    groups: list[str], window: int = 256, block_size: int = 16, num_blocks: int = 4000, caching: bool = False
) -> Any:
    """vLLM's own KV cache manager, one KV-cache group per entry of `groups` ("full" or "sliding")."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    common: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": 2,
        "head_size": 32,
        "dtype": torch.float32,
    }
    specs = [
        KVCacheGroupSpec(
            [f"layer{i}"],
            FullAttentionSpec(**common)
            if kind == "full"
            else SlidingWindowSpec(sliding_window=window, **common),
        )
        for i, kind in enumerate(groups)
    ]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=specs)
    return KVCacheManager(
        config,
        max_model_len=4096,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=caching,
        max_in_flight_tokens=2048,
    )


@pytest.mark.parametrize(
    "groups", [["full"], ["full", "full"], ["sliding"] * 5 + ["full"]], ids=["one", "two-full", "gemma3-like"]
)
@pytest.mark.parametrize("num_tokens", [1, 100, 2000])
def test_a_request_is_sized_in_every_kv_cache_group_as_vllm_allocates_it(
    groups: list[str], num_tokens: int
) -> None:
    """A model with several KV-cache groups (sliding-window and full-attention layers) takes
    blocks in each from one pool: sized as one group, a 2,000-token prompt on a Gemma-3-like
    layout read 125 blocks where vLLM took 750, and the plug-in preempted too little for it."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    manager = _manager(groups)
    free = manager.block_pool.get_num_free_blocks()
    request = Request("r", list(range(num_tokens)), SamplingParams(max_tokens=8), None)
    assert manager.allocate_slots(request, num_tokens) is not None
    taken = free - manager.block_pool.get_num_free_blocks()
    assert blocks_to_hold(manager, num_tokens, num_tokens) == taken
    scheduler = SimpleNamespace(kv_cache_manager=manager, num_lookahead_tokens=0, block_size=16)
    assert TierScheduler._blocks_for(scheduler, num_tokens) == taken + manager.watermark_blocks  # type: ignore[arg-type]
    assert taken == len(groups) * -(-num_tokens // 16)  # a chunk's blocks, in every group


def test_the_sliding_window_caps_what_a_long_request_is_sized_at() -> None:
    """vLLM recycles the blocks a chunked prefill leaves behind a sliding window, and sizes
    a request for admission with a cap on those groups; so does the plug-in."""
    manager = _manager(["sliding", "full"], window=64)
    cap = manager.coordinator.single_type_managers[0].max_admission_blocks_per_request
    assert cap is not None and cap < 4000 // 16
    assert blocks_to_hold(manager, 4000, 4000) == cap + 250


@pytest.mark.parametrize("delivery", [True, False])
def test_a_boundary_preemption_is_made_as_vllm_makes_its_own(delivery: bool) -> None:
    """With a KV connector that hands KV off, the output of a step in flight for a victim is
    dropped (vLLM's `drop_stale_output`), not delivered for blocks already freed; and a
    victim is no longer one the previous step scheduled, since it may be resumed in this
    same pass (as vLLM's `reset_prefix_cache` has it)."""
    made: list[tuple[str, bool]] = []
    victim, other = SimpleNamespace(request_id="v"), SimpleNamespace(request_id="w")
    scheduler = SimpleNamespace(
        running=[other, victim],
        prev_step_scheduled_req_ids={"v", "w"},
        requires_kv_delivery=delivery,
        _preempt_request=lambda r, now, drop_stale_output=False: made.append(
            (r.request_id, drop_stale_output)
        ),
    )
    TierScheduler._preempt_all(scheduler, [victim], 1.0)  # type: ignore[arg-type]
    assert made == [("v", delivery)]
    assert scheduler.running == [other] and scheduler.prev_step_scheduled_req_ids == {"w"}


def test_sizing_leaves_no_entry_in_a_manager_that_indexes_a_defaultdict() -> None:
    """vLLM's Mamba manager (mamba_cache_mode "align") indexes `req_to_blocks[request_id]`, a
    defaultdict: sizing left an empty entry under its made-up request id."""
    from collections import defaultdict

    held: defaultdict[str, list[int]] = defaultdict(list)
    held["a-request"].append(1)

    def get_num_blocks_to_allocate(request_id: str, **_: Any) -> int:
        return len(held[request_id]) + 3

    group = SimpleNamespace(req_to_blocks=held)
    coordinator = SimpleNamespace(
        get_num_blocks_to_allocate=get_num_blocks_to_allocate, single_type_managers=[group]
    )
    manager = SimpleNamespace(coordinator=coordinator, empty_kv_cache_blocks=SimpleNamespace(blocks=()))
    assert blocks_to_hold(manager, 100, 100) == 3
    assert list(held) == ["a-request"]


def test_a_prefix_other_requests_hold_is_not_counted_again() -> None:
    """A P0 request whose first 192 tokens (a system prompt, say) a running request holds
    takes only the rest from the pool; sized from scratch it read all 13 blocks, and the
    plug-in preempted lower tiers for 12 blocks it would not take."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    manager = _manager(["full"], caching=True)
    system = list(range(1, 193))  # 12 blocks
    running = Request("running", [*system, 500, 501], SamplingParams(max_tokens=8), None, block_hasher=hasher)
    blocks, num_hit, _ = manager.get_computed_blocks(running)
    assert manager.allocate_slots(running, running.num_tokens, num_hit, blocks) is not None
    head = Request("head", [*system, 600, 601, 602], SamplingParams(max_tokens=8), None, block_hasher=hasher)
    free = manager.block_pool.get_num_free_blocks()
    blocks, num_hit, _ = manager.get_computed_blocks(head)
    assert num_hit == 192
    assert manager.allocate_slots(head, head.num_tokens - num_hit, num_hit, blocks) is not None
    taken = free - manager.block_pool.get_num_free_blocks()
    assert taken == 1  # its own last block: the 12 of the prompt are shared
    manager.free(head)  # back to waiting, as the plug-in sees it before vLLM admits it
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(inner=manager), num_lookahead_tokens=0)
    scheduler._blocks_for = lambda n, hit=None: TierScheduler._blocks_for(scheduler, n, hit)  # type: ignore[arg-type]
    assert TierScheduler._blocks_to_admit(scheduler, head)[0] == taken  # type: ignore[arg-type]
