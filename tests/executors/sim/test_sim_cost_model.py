from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierserve.executors.sim.cost_model import CostModel, SeqChunk
from tierserve.executors.sim.gpus import A100_80GB, H100_80GB, H200, GiB, GpuProfile, get_gpu
from tierserve.model_config import DEMO_MODEL, LLAMA_3_1_8B, LLAMA_3_1_70B, ModelConfig

Config = tuple[GpuProfile, ModelConfig, int]
CONFIGS: list[Config] = [
    (H100_80GB, LLAMA_3_1_8B, 1),
    (A100_80GB, LLAMA_3_1_70B, 8),
    (H200, LLAMA_3_1_70B, 4),
]
chunk = st.builds(SeqChunk, st.integers(1, 4096), st.integers(0, 32768))


def test_kv_capacity_of_70b_on_8xa100_matches_hand_calculation() -> None:
    cm = CostModel(A100_80GB, LLAMA_3_1_70B, tp=8)
    # Per GPU: 79.15 GiB as CUDA reports it, x 0.9, minus the weights (70,553,706,496 params
    # x 2 bytes / 8 = 17,638,426,624 bytes), minus the 2 GiB activation reserve.
    free_per_gpu = int(79.15 * 2**30) * 0.9 - 17_638_426_624 - 2 * 2**30
    # K/V per token: 2 (K, V) x 80 layers x 8 KV heads x 128 dims x 2 bytes = 327,680 bytes,
    # split over 8 GPUs (one KV head each) = 40,960 bytes per GPU.
    assert cm.kv_bytes_per_token == 327_680
    assert cm.kv_bytes_per_token_per_gpu == 40_960
    expected = int(free_per_gpu // 40_960)
    assert cm.kv_capacity_tokens(mem_util=0.9, activation_reserve_bytes=2 * GiB) == expected
    assert 1_380_000 < expected < 1_390_000  # about 1.38 M tokens, 86 k blocks of 16


def test_kv_capacity_grows_with_memory_utilization_and_is_never_negative() -> None:
    cm = CostModel(H100_80GB, LLAMA_3_1_70B, tp=1)  # 141 GB of weights cannot fit one 80 GB GPU
    assert cm.kv_capacity_tokens(0.9) == 0
    cm8 = CostModel(H100_80GB, LLAMA_3_1_8B)
    assert cm8.kv_capacity_tokens(0.5) < cm8.kv_capacity_tokens(0.9)


def test_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    cm = CostModel(H100_80GB, DEMO_MODEL, tp=4)  # 2 KV heads over 4 GPUs: one copy per GPU
    assert cm.kv_bytes_per_token_per_gpu == DEMO_MODEL.kv_bytes_per_token // 2
    assert cm.kv_bytes_per_token == 2 * DEMO_MODEL.kv_bytes_per_token


@pytest.mark.parametrize("tp", [0, 3, 6])
def test_tp_that_does_not_split_the_model_is_rejected(tp: int) -> None:
    with pytest.raises(ValueError, match="tp"):
        CostModel(A100_80GB, LLAMA_3_1_70B, tp=tp)


def test_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"a100-80gb, h100-80gb, h200"):
        get_gpu("v100")


def test_llama_8b_on_one_h100_decodes_and_prefills_at_published_speeds() -> None:
    cm = CostModel(H100_80GB, LLAMA_3_1_8B)
    # 15 GB of weights at 3.35 TB/s is 4.5 ms: vLLM-class engines take 6-10 ms at batch 1.
    assert 0.006 < cm.decode_step_s(1, 2048) < 0.010
    # 2 x 7.5e9 x 2048 FLOPs at 989 TFLOP/s is 31 ms; real prefills reach 50-80 % of peak.
    assert 0.035 < cm.prefill_s(2048) < 0.080


def test_llama_70b_on_8xa100_decodes_and_prefills_at_published_speeds() -> None:
    cm = CostModel(A100_80GB, LLAMA_3_1_70B, tp=8)
    assert 0.015 < cm.decode_step_s(1, 2048) < 0.035
    assert 0.015 < cm.decode_step_s(32, 2048) < 0.035
    assert 0.15 < cm.prefill_s(2048) < 0.40


def test_h200_is_faster_than_h100_and_h100_than_a100_for_decode() -> None:
    times = [CostModel(g, LLAMA_3_1_8B).decode_step_s(8, 1024) for g in (A100_80GB, H100_80GB, H200)]
    assert times[0] > times[1] > times[2]


@pytest.mark.parametrize(("gpu", "model", "tp"), CONFIGS)
def test_roofline_is_a_lower_bound_on_the_predicted_time(
    gpu: GpuProfile, model: ModelConfig, tp: int
) -> None:
    cm = CostModel(gpu, model, tp)
    for chunks in ([SeqChunk(1, 100)], [SeqChunk(1, 4000)] * 64, [SeqChunk(2048, 0)], [SeqChunk(512, 8000)]):
        cost = cm.step_cost(chunks)
        assert 0 < cost.roofline_s < cost.total_s


def test_empty_step_costs_nothing() -> None:
    cm = CostModel(H100_80GB, LLAMA_3_1_8B)
    assert cm.step_s([]) == 0.0
    assert cm.step_s([SeqChunk(0, 100)]) == 0.0
    assert cm.roofline_s([]) == 0.0


def test_tensor_parallelism_adds_all_reduce_time_and_cuts_weight_time() -> None:
    one = CostModel(H100_80GB, LLAMA_3_1_8B, tp=1).step_cost([SeqChunk(1, 1000)])
    two = CostModel(H100_80GB, LLAMA_3_1_8B, tp=2).step_cost([SeqChunk(1, 1000)])
    assert one.allreduce_s == 0 < two.allreduce_s
    assert two.linear_s < one.linear_s


def test_swap_time_is_kv_bytes_per_gpu_over_the_host_link() -> None:
    cm = CostModel(A100_80GB, LLAMA_3_1_70B, tp=8)
    assert cm.swap_s(0) == 0.0
    assert cm.swap_s(100, block_size=16) == pytest.approx(100 * 16 * 40_960 / 25e9)
    assert cm.swap_s(200) == pytest.approx(2 * cm.swap_s(100))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(CONFIGS),
    st.lists(chunk, min_size=1, max_size=8),
    st.integers(1, 512),
    st.integers(1, 4096),
)
def test_more_tokens_context_or_sequences_never_take_less_time(
    config: Config, chunks: list[SeqChunk], extra_tokens: int, extra_ctx: int
) -> None:
    cm = CostModel(*config)
    base = cm.step_s(chunks)
    first = chunks[0]
    more_tokens = [SeqChunk(first.num_tokens + extra_tokens, first.num_context_tokens), *chunks[1:]]
    more_context = [SeqChunk(first.num_tokens, first.num_context_tokens + extra_ctx), *chunks[1:]]
    assert cm.step_s(more_tokens) >= base
    assert cm.step_s(more_context) >= base
    assert cm.step_s([*chunks, SeqChunk(1, extra_ctx)]) >= base
    assert cm.roofline_s(more_tokens) >= cm.roofline_s(chunks)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(CONFIGS), st.integers(1, 255), st.integers(0, 16384))
def test_decode_step_grows_with_batch_and_context(config: Config, batch: int, context: int) -> None:
    cm = CostModel(*config)
    assert cm.decode_step_s(batch + 1, context) > cm.decode_step_s(batch, context)
    assert cm.decode_step_s(batch, context + 1024) > cm.decode_step_s(batch, context)


def test_prefill_in_one_chunk_is_cheaper_than_token_by_token() -> None:
    cm = CostModel(H100_80GB, LLAMA_3_1_8B)
    whole = cm.prefill_s(512)
    piecewise = sum(cm.prefill_s(1, k) for k in range(512))
    assert whole < piecewise / 10


def test_a_gpu_is_found_by_its_family_name_as_the_readme_names_it() -> None:
    """`--gpu a100` was refused (the names are a100-80gb, ...) where the README says A100."""
    from tierserve.executors.sim.gpus import KNOWN_GPUS

    assert get_gpu("A100") is KNOWN_GPUS["a100-80gb"] and get_gpu("h100") is KNOWN_GPUS["h100-80gb"]
    assert get_gpu("H200") is KNOWN_GPUS["h200"]
    with pytest.raises(ValueError, match="unknown GPU 'a10'"):
        get_gpu("a10")
