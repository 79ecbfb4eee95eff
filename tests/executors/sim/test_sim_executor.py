from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import make_request
from tierserve.clock import VirtualClock
from tierserve.config import EngineConfig
from tierserve.executors.base import Executor, ScheduledSeq, StepBatch
from tierserve.executors.sim.cost_model import SeqChunk
from tierserve.executors.sim.executor import (
    PlaceholderTokens,
    SimExecutor,
    build_sim_executor,
    placeholder_token,
)
from tierserve.executors.sim.gpus import A100_80GB, GiB
from tierserve.model_config import DEMO_MODEL, LLAMA_3_1_8B, LLAMA_3_1_70B, ModelConfig


def test_spec_derives_blocks_from_kv_capacity_and_host_swap_bytes() -> None:
    ex = SimExecutor(LLAMA_3_1_70B, A100_80GB, tp=8, block_size=16, host_swap_bytes=64 * GiB)
    assert ex.spec.num_device_blocks == ex.cost.kv_capacity_tokens(0.9) // 16
    assert ex.spec.num_host_blocks == 64 * GiB // (16 * 40_960)
    assert ex.spec.kv_bytes_per_block == 16 * 327_680
    assert ex.spec.max_model_len == LLAMA_3_1_70B.max_position_embeddings
    assert ex.spec.eos_token_ids == LLAMA_3_1_70B.eos_token_ids


def test_block_count_override_and_max_model_len_cap() -> None:
    ex = SimExecutor(LLAMA_3_1_8B, A100_80GB, num_device_blocks=100, max_model_len=4096)
    assert ex.spec.num_device_blocks == 100
    assert ex.spec.max_model_len == 100 * 16  # no request can hold more than the pool
    ex = SimExecutor(LLAMA_3_1_8B, A100_80GB, num_device_blocks=1000, max_model_len=4096)
    assert ex.spec.max_model_len == 4096


def test_model_that_does_not_fit_is_rejected() -> None:
    with pytest.raises(ValueError, match="no memory"):
        SimExecutor(LLAMA_3_1_70B, A100_80GB, tp=1)


def test_execute_samples_exactly_the_sequences_whose_chunk_reaches_the_end() -> None:
    ex = SimExecutor(LLAMA_3_1_8B, A100_80GB, num_device_blocks=1000)
    decoding = make_request(num_prompt=10)
    decoding.num_computed_tokens = 9  # one token left to compute: it samples
    finishing = make_request(num_prompt=40)
    finishing.num_computed_tokens = 8
    partial = make_request(num_prompt=100)  # a 32-token chunk of 100: does not sample
    batch = StepBatch(
        decodes=[ScheduledSeq(decoding, 1)],
        prefills=[ScheduledSeq(finishing, 32), ScheduledSeq(partial, 32)],
    )
    result = ex.execute(batch)
    assert set(result.sampled_token_ids) == {decoding.request_id, finishing.request_id}
    expected = ex.cost.step_cost([SeqChunk(1, 9), SeqChunk(32, 8), SeqChunk(32, 0)])
    assert result.duration_s == pytest.approx(expected.total_s)
    assert result.roofline_s == pytest.approx(expected.roofline_s)


@pytest.mark.parametrize("model", [LLAMA_3_1_8B, DEMO_MODEL])
def test_placeholder_tokens_are_deterministic_varied_and_never_eos(model: ModelConfig) -> None:
    tokens = [placeholder_token(model, f"r{i}", p) for i in range(50) for p in range(40)]
    assert tokens == [placeholder_token(model, f"r{i}", p) for i in range(50) for p in range(40)]
    assert not set(tokens) & {*model.eos_token_ids, model.bos_token_id}
    assert all(0 <= t < model.vocab_size for t in tokens)
    assert len(set(tokens)) > 100


def test_swaps_cost_the_predicted_host_link_time() -> None:
    ex = SimExecutor(LLAMA_3_1_70B, A100_80GB, tp=8)
    mapping = [(i, i) for i in range(64)]
    assert ex.swap_out(mapping) == ex.swap_in(mapping) == pytest.approx(ex.estimate_swap_s(64))
    assert ex.estimate_swap_s(64) == pytest.approx(64 * 16 * 40_960 / A100_80GB.host_link_bytes_per_s)
    assert ex.estimate_prefill_s(2048) == pytest.approx(ex.cost.prefill_s(2048))


def test_build_sim_executor_by_name_and_errors_for_unknown_names() -> None:
    ex = build_sim_executor("llama-3.1-70b", "A100-80GB", tp=8, block_size=32)
    assert ex.spec.block_size == 32 and ex.tp == 8
    with pytest.raises(ValueError, match=r"known GPUs: a100-80gb, h100-80gb, h200"):
        build_sim_executor("llama-3.1-8b", "b200")
    with pytest.raises(ValueError, match=r"known models: demo, llama-3.1-70b, llama-3.1-8b"):
        build_sim_executor("mistral-7b", "h200")


def test_sim_executor_drives_the_engine_on_a_virtual_clock() -> None:
    from tierserve.engine import Engine

    executor: Executor = SimExecutor(LLAMA_3_1_70B, A100_80GB, tp=8, num_device_blocks=2048)
    clock = VirtualClock()
    engine = Engine(EngineConfig(), "fcfs", executor, clock)
    requests = [make_request(num_prompt=300, max_tokens=20) for _ in range(4)]
    for req in requests:
        assert engine.add_request(req)
    steps = 0
    while engine.has_unfinished() and steps < 1000:
        engine.step()
        steps += 1
    assert all(req.num_output_tokens == 20 for req in requests)
    # 19 more decode steps of ~20 ms after the prefill: the virtual clock moved by about that.
    assert 0.3 < clock.now() < 1.5
    assert 0 < engine.stats.roofline_s < engine.stats.busy_s


@pytest.mark.parametrize(
    "tokens",
    [
        PlaceholderTokens.of(LLAMA_3_1_8B),
        PlaceholderTokens(limit=10, vocab_size=12, special=frozenset({3, 4, 9})),  # specials hit often
    ],
    ids=["llama-3.1-8b", "tiny-vocab"],
)
def test_runs_of_tokens_are_the_tokens_one_by_one(tokens: PlaceholderTokens) -> None:
    """`tokens` draws runs ahead in numpy and serves later reads from them: every read, in
    any order (a recompute reads from the start again), equals `token` position by position."""
    reads = [
        (0, 16),
        (16, 32),
        (32, 48),
        (5, 9),
        (250, 300),
        (300, 301),
        (0, 600),
        (1000, 1000),
        (2**40, 2**40 + 70),
    ]
    for request_id in ("r0", "a-longer-request-id", "r0"):
        for start, stop in reads:
            expected = [tokens.at(((request_id, p),))[request_id] for p in range(start, stop)]
            assert tokens.tokens(request_id, start, stop) == expected
    assert not tokens.special & set(tokens.tokens("r1", 0, 2000))


def test_drawn_runs_are_kept_for_a_bounded_number_of_requests() -> None:
    """Kept for every request a replica ever saw, the runs held gigabytes in a fleet."""
    from tierserve.executors.sim.executor import AHEAD_MEMO_SIZE

    tokens = PlaceholderTokens.of(LLAMA_3_1_8B)
    for i in range(AHEAD_MEMO_SIZE + 10):
        tokens.tokens(f"r{i}", 0, 16)
    assert 0 < len(tokens._ahead) <= AHEAD_MEMO_SIZE


def _llama_8b_directory(folder: Path, dtype: str) -> str:
    """Llama-3.1-8B's config.json written out, in `dtype`."""
    m = LLAMA_3_1_8B
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.intermediate_size,
        "num_hidden_layers": m.num_hidden_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_key_value_heads,
        "max_position_embeddings": m.max_position_embeddings,
        "torch_dtype": dtype,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_local_model_directory_builds_the_same_executor_as_its_built_in_name(tmp_path: Path) -> None:
    """`serve --backend sim --model DIR` and `profile --model DIR` go through this: the config
    of Llama-3.1-8B written out gives the built-in model's blocks and context."""
    local = build_sim_executor(_llama_8b_directory(tmp_path, "bfloat16"), "a100-80gb")
    built_in = build_sim_executor("llama-3.1-8b", "a100-80gb")
    assert local.spec.num_device_blocks == built_in.spec.num_device_blocks
    assert local.spec.max_model_len == built_in.spec.max_model_len


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_float32_checkpoint_is_priced_in_the_16_bits_a_gpu_runs_it_in(tmp_path: Path, dtype: str) -> None:
    """vLLM's dtype "auto" and the torch executor on a GPU both run a float32 checkpoint in
    16 bits: at 4 bytes its K/V capacity was 2.6x too small and its decode steps 1.7x too long."""
    local = build_sim_executor(_llama_8b_directory(tmp_path, dtype), "a100-80gb")
    built_in = build_sim_executor("llama-3.1-8b", "a100-80gb")
    assert local.spec.num_device_blocks == built_in.spec.num_device_blocks
    assert local.cost.decode_step_cost(1, 1000) == built_in.cost.decode_step_cost(1, 1000)


@pytest.mark.parametrize(
    ("rope", "context"),
    [
        # Qwen2.5's and Qwen3's model cards: YaRN, factor 4, over the 32,768 trained positions.
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        ({"type": "dynamic", "factor": 2.0}, 65536),
        ({"rope_type": "linear", "factor": 2.0}, 65536),
        ({"rope_type": "longrope", "factor": 4.0}, 32768),  # already the scaled context
    ],
)
def test_the_simulator_reads_any_rope_scaling_and_serves_vllms_context(
    tmp_path: Path, rope: dict[str, object], context: int
) -> None:
    """No rotation changes a step's work or the K/V it keeps: a YaRN model was refused."""
    folder = Path(_llama_8b_directory(tmp_path, "bfloat16"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps({**config, "max_position_embeddings": 32768, "rope_scaling": rope})
    )
    local = build_sim_executor(str(folder), "h100-80gb")
    built_in = build_sim_executor("llama-3.1-8b", "h100-80gb")
    assert local.spec.max_model_len == context
    assert local.spec.num_device_blocks == built_in.spec.num_device_blocks


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),  # was read as tied: 0.13 B too few
        ({"torch_dtype": "float8_e4m3fn"}, "float8_e4m3fn"),  # was priced as 16 bits
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0}}, "factor"),
    ],
)
def test_a_config_the_simulator_would_misprice_is_refused(
    tmp_path: Path, change: dict[str, object], says: str
) -> None:
    folder = Path(_llama_8b_directory(tmp_path, "bfloat16"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=says):
        build_sim_executor(str(folder), "h100-80gb")


def test_yarn_reads_a_top_level_original_context_and_refuses_two_that_differ(tmp_path: Path) -> None:
    folder = Path(_llama_8b_directory(tmp_path, "bfloat16"))
    config = json.loads((folder / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(
        json.dumps({**config, "rope_scaling": yarn, "original_max_position_embeddings": 16384})
    )
    assert build_sim_executor(str(folder), "h100-80gb").spec.max_model_len == 65536
    both = {**yarn, "original_max_position_embeddings": 32768}
    (folder / "config.json").write_text(
        json.dumps({**config, "rope_scaling": both, "original_max_position_embeddings": 16384})
    )
    with pytest.raises(ValueError, match="16384 at the top level and 32768"):
        build_sim_executor(str(folder), "h100-80gb")


def test_a_dtype_written_with_torchs_prefix_is_read_as_the_dtype(tmp_path: Path) -> None:
    local = build_sim_executor(_llama_8b_directory(tmp_path, "torch.bfloat16"), "a100-80gb")
    assert (
        local.spec.num_device_blocks == build_sim_executor("llama-3.1-8b", "a100-80gb").spec.num_device_blocks
    )
