"""What config.json's architecture keys build (biases, Qwen3's head_dim), and what is refused."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch_checkpoints import Checkpoint, edit_json
from torch_paged_runner import prompt_logits

from tierserve.executors.pytorch.executor import build_torch_executor
from tierserve.executors.pytorch.hf_config import ModelLoadError, parse_hf_config
from tierserve.executors.pytorch.loader import load_model

CPU = torch.device("cpu")
PROMPT = [5, 9, 200, 31, 7, 64, 2]


def edit_config(ckpt: Checkpoint, **changes: object) -> None:
    edit_json(ckpt.path / "config.json", **changes)


def load_error(ckpt: Checkpoint) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(ckpt.path, CPU)
    return str(info.value)


def test_qwen3_without_head_dim_or_architectures_takes_transformers_defaults(
    make_checkpoint: Callable[..., Checkpoint],
) -> None:
    # Qwen3Config's head_dim defaults to 128, not hidden_size / heads (64 / 4 here).
    ckpt = make_checkpoint(arch="qwen3")
    edit_config(ckpt, head_dim=None, architectures=None)  # model_type "qwen3" names it
    executor, _ = build_torch_executor(ckpt.path, dtype=torch.float64, num_device_blocks=8)
    assert executor.model.config.head_size == 128
    torch.testing.assert_close(prompt_logits(executor, PROMPT), ckpt.logits(PROMPT), atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize(
    ("arch", "key"),
    [("mistral", "attention_bias"), ("mistral", "mlp_bias"), ("qwen3", "mlp_bias")],
)
def test_a_bias_key_the_architectures_transformers_class_ignores_is_refused(
    make_checkpoint: Callable[..., Checkpoint], arch: str, key: str
) -> None:
    # transformers would build these without the biases, vLLM with them: no single answer.
    ckpt = make_checkpoint(arch=arch)
    edit_config(ckpt, **{key: True})
    message = load_error(ckpt)
    assert "config.json" in message and key in message and "ForCausalLM" in message


def test_a_bias_key_that_is_not_a_boolean_is_refused(checkpoint: Checkpoint) -> None:
    edit_config(checkpoint, attention_bias="false")
    message = load_error(checkpoint)
    assert "attention_bias" in message and "true or false" in message and "'false'" in message


@pytest.mark.parametrize(
    "change",
    [
        # Without layer_types, transformers slides the window from max_window_layers on.
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1, "layer_types": None},
        {"layer_types": ["full_attention", "sliding_attention"]},
    ],
    ids=["use_sliding_window", "layer_types"],
)
def test_qwen3_sliding_window_attention_is_refused(
    make_checkpoint: Callable[..., Checkpoint], change: dict[str, object]
) -> None:
    ckpt = make_checkpoint(arch="qwen3")
    edit_config(ckpt, **change)
    message = load_error(ckpt)
    assert "config.json" in message and next(iter(change)) in message


def test_biases_in_the_weights_that_config_json_does_not_declare_are_refused(
    make_checkpoint: Callable[..., Checkpoint],
) -> None:
    # Loading without them would silently compute another model.
    ckpt = make_checkpoint(attention_bias=True)
    edit_config(ckpt, attention_bias=None)
    message = load_error(ckpt)
    assert "model.safetensors" in message and "_proj.bias" in message and "attention_bias" in message


def test_biases_that_config_json_declares_must_be_in_the_weights(checkpoint: Checkpoint) -> None:
    edit_config(checkpoint, mlp_bias=True)
    message = load_error(checkpoint)
    assert "mlp." in message and ".bias" in message and "not found" in message


def test_layers_beyond_num_hidden_layers_in_the_weights_are_refused(checkpoint: Checkpoint) -> None:
    edit_config(checkpoint, num_hidden_layers=1)  # the file has layers 0 and 1
    message = load_error(checkpoint)
    assert "model.layers.1." in message and "num_hidden_layers" in message


def test_a_mistral_file_without_sliding_window_slides_transformers_default_window(
    make_checkpoint: Callable[..., Checkpoint],
) -> None:
    """MistralConfig's sliding_window is 4096 when the file leaves it out (null: none); the
    loader read absent as none and ran past 4096 tokens with full attention."""
    ckpt = make_checkpoint(arch="mistral")
    edit_config(ckpt, sliding_window=None, max_position_embeddings=32768)
    assert load_model(ckpt.path, CPU).max_model_len == 4096
    config = json.loads((ckpt.path / "config.json").read_text())
    config["sliding_window"] = None  # written as null: no window
    (ckpt.path / "config.json").write_text(json.dumps(config))
    assert load_model(ckpt.path, CPU).max_model_len == 32768


def test_absent_key_value_heads_take_the_architectures_default_and_null_means_one_per_head() -> None:
    from tierserve.executors.pytorch.hf_config import parse_hf_config

    def heads(tmp: Path, **config: object) -> int:
        base = {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 16,
        }
        (tmp / "config.json").write_text(json.dumps({**base, **config}))
        return parse_hf_config(tmp / "config.json").config.num_key_value_heads

    with tempfile.TemporaryDirectory() as tmp:
        assert heads(Path(tmp)) == 8  # MistralConfig's default
        assert heads(Path(tmp), num_key_value_heads=None) == 16


def test_architectures_and_model_type_must_agree(make_checkpoint: Callable[..., Checkpoint]) -> None:
    """transformers builds by model_type: a Llama-named file of model_type "mistral" slid a
    window that the Llama reading ignored."""
    ckpt = make_checkpoint(arch="mistral")
    edit_config(ckpt, architectures=["LlamaForCausalLM"], sliding_window=16)
    assert "architectures names LlamaForCausalLM but model_type 'mistral'" in load_error(ckpt)


def test_rope_scaling_beside_rope_parameters_must_agree(make_checkpoint: Callable[..., Checkpoint]) -> None:
    """transformers reads rope_scaling first; the loader read rope_parameters and ran an
    unscaled rotation where transformers scaled it."""
    ckpt = make_checkpoint()
    edit_config(ckpt, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    edit_config(ckpt, rope_scaling={"type": "linear", "factor": 4.0})
    assert "rope_scaling" in load_error(ckpt) and "disagree" in load_error(ckpt)
    edit_config(ckpt, rope_parameters={"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0})
    assert load_model(ckpt.path, CPU).model is not None  # the same rotation said twice
    # The base too: transformers takes rope_scaling's theta, else the top-level one (10000 here).
    edit_config(
        ckpt, rope_theta=None, rope_parameters={"rope_theta": 500000.0, "rope_type": "linear", "factor": 4.0}
    )
    assert "disagree" in load_error(ckpt)


@pytest.mark.parametrize(("act", "loads"), [("swish", True), ("gelu", False)])
def test_swish_is_silu_and_other_activations_are_refused(
    checkpoint: Checkpoint, act: str, loads: bool
) -> None:
    edit_config(checkpoint, hidden_act=act)
    if loads:
        executor, _ = build_torch_executor(checkpoint.path, dtype=torch.float64, num_device_blocks=8)
        torch.testing.assert_close(
            prompt_logits(executor, PROMPT), checkpoint.logits(PROMPT), atol=1e-9, rtol=1e-9
        )
    else:
        assert "hidden_act 'gelu' is not supported" in load_error(checkpoint)


def test_a_quantized_checkpoint_is_refused_naming_its_method(checkpoint: Checkpoint) -> None:
    """It failed the tensor checks with a message about biases and shapes."""
    edit_config(checkpoint, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert "quantized weights (fp8) are not supported" in load_error(checkpoint)


# ---- configs as other tools wrote them (a review with checkpoints the tests never wrote) ----


def _parse_error(tmp_path: Path, config: dict[str, object]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        parse_hf_config(path)
    return str(info.value)


def _base_config(**changes: object) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    config.update(changes)
    return {k: v for k, v in config.items() if v is not None}


def test_an_unsupported_model_type_is_named(tmp_path: Path) -> None:
    message = _parse_error(tmp_path, _base_config(architectures=None, model_type="gemma"))
    assert "model_type 'gemma' is not supported" in message and "llama" in message


def test_a_model_type_that_is_not_a_string_is_named(tmp_path: Path) -> None:
    message = _parse_error(tmp_path, _base_config(architectures=None, model_type=["llama"]))
    assert "config.json: model_type: expected a string" in message


def test_an_early_llama_conversions_architecture_name_is_llama(checkpoint: Checkpoint) -> None:
    """Llama-1 conversions say "LLaMAForCausalLM"; transformers builds by model_type."""
    edit_config(checkpoint, architectures=["LLaMAForCausalLM"])
    executor, _ = build_torch_executor(checkpoint.path, dtype=torch.float64, num_device_blocks=8)
    torch.testing.assert_close(
        prompt_logits(executor, PROMPT), checkpoint.logits(PROMPT), atol=1e-9, rtol=1e-9
    )


def test_llama3_original_positions_that_are_not_an_integer_are_refused(tmp_path: Path) -> None:
    """32.7 was read as 32: the rotation then differed from transformers' from token 11 on."""
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32.7,
    }
    message = _parse_error(tmp_path, _base_config(rope_scaling=scaling))
    assert "original_max_position_embeddings: must be a positive integer, got 32.7" in message
    path = tmp_path / "config.json"  # a whole number written as a float is read as transformers reads it
    path.write_text(
        json.dumps(_base_config(rope_scaling={**scaling, "original_max_position_embeddings": 32.0}))
    )
    rope = parse_hf_config(path).config.rope_scaling
    assert rope is not None and rope.original_max_position_embeddings == 32


@pytest.mark.parametrize("window", ["32", 0, 1.5, True])
def test_a_mistral_sliding_window_that_is_not_a_positive_integer_is_refused(
    tmp_path: Path, window: object
) -> None:
    """Such a window was ignored: full attention over 512 tokens, where transformers refuses
    the config (or slides a window)."""
    config = _base_config(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=window)
    assert "sliding_window: must be a positive integer" in _parse_error(tmp_path, config)


def test_a_context_capped_by_mistrals_window_says_so(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            _base_config(
                architectures=["MistralForCausalLM"],
                model_type="mistral",
                sliding_window=32,
                max_position_embeddings=512,
            )
        )
    )
    spec = parse_hf_config(path)
    assert spec.max_model_len == 32 and "sliding_window" in spec.context_said()
    path.write_text(json.dumps(_base_config(max_position_embeddings=512)))
    assert parse_hf_config(path).context_said() == "the model's context of 512 tokens"


def test_a_mistral_file_with_layer_types_slides_no_window_where_no_layer_slides(tmp_path: Path) -> None:
    """transformers builds a Mistral file that has layer_types as Ministral, whose layers slide
    the window only where layer_types says so: every layer full attention, no window applies
    (the loader capped such a model's context at the window)."""
    path = tmp_path / "config.json"
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 24}
    path.write_text(json.dumps(_base_config(**mistral, max_position_embeddings=512)))
    assert parse_hf_config(path).max_model_len == 24  # without layer_types: the window caps it
    layers = ["full_attention", "full_attention"]  # one a layer
    path.write_text(json.dumps(_base_config(**mistral, max_position_embeddings=512, layer_types=layers)))
    spec = parse_hf_config(path)
    assert spec.max_model_len == 512 and spec.context_note == ""
    sliding = ["sliding_attention", *layers[1:]]
    path.write_text(json.dumps(_base_config(**mistral, max_position_embeddings=512, layer_types=sliding)))
    with pytest.raises(ModelLoadError, match="only full_attention layers are supported"):
        parse_hf_config(path)


def test_a_refusal_for_length_says_the_window_is_why(make_checkpoint: Callable[..., Checkpoint]) -> None:
    """A Mistral model's context capped at its sliding window: the engine's refusal said only
    "the model's context of 24 tokens", for a model of 131,072 positions."""
    from tierserve.clock import VirtualClock
    from tierserve.config import EngineConfig
    from tierserve.engine import Engine
    from tierserve.request import Request, SamplingParams

    ckpt = make_checkpoint(arch="mistral")
    edit_config(ckpt, sliding_window=24, max_position_embeddings=4096)
    executor, _ = build_torch_executor(ckpt.path, num_device_blocks=8)
    assert executor.spec.max_model_len == 24 and "sliding_window" in executor.spec.context_note
    engine = Engine(EngineConfig(), "fcfs", executor, VirtualClock())
    request = Request("long", list(range(1, 21)), SamplingParams(max_tokens=8))
    assert not engine.add_request(request)
    assert "exceeds the model's context of 24 tokens (its sliding_window" in str(request.reject_reason)


def test_transformers_dtype_key_wins_over_torch_dtype(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_base_config(dtype="bfloat16", torch_dtype="float16")))
    assert parse_hf_config(path).checkpoint_dtype == "bfloat16"


def test_qwen2_use_sliding_window_with_no_sliding_layer_runs_as_transformers_builds_it(
    make_checkpoint: Callable[..., Checkpoint],
) -> None:
    """Without layer_types, transformers slides the window in the layers from
    max_window_layers on: none when that is the number of layers (it was refused), some when
    it is fewer (refused). Given, layer_types decide (saved ones say full_attention)."""
    ckpt = make_checkpoint(arch="qwen2")
    edit_config(ckpt, use_sliding_window=True, sliding_window=4, max_window_layers=2, layer_types=None)
    executor, _ = build_torch_executor(ckpt.path, dtype=torch.float64, num_device_blocks=8)
    torch.testing.assert_close(prompt_logits(executor, PROMPT), ckpt.logits(PROMPT), atol=1e-9, rtol=1e-9)
    edit_config(ckpt, max_window_layers=1)
    message = load_error(ckpt)
    assert "use_sliding_window" in message and "max_window_layers (1)" in message


def test_yarn_original_positions_written_as_a_whole_float_are_read_for_the_simulator(tmp_path: Path) -> None:
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192.0}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_base_config(rope_scaling=scaling, max_position_embeddings=32768)))
    assert parse_hf_config(path, simulated=True).max_model_len == 32768
